"""The clouds a VM is made in: the interface a provider implements, and one folder per provider."""
