"""The TPU VM and Google's APIs, driven from the laptop: Compute Engine VMs and their lifecycle, SSH, checks before spending, the TPU VM's lock, the run on the VM."""
