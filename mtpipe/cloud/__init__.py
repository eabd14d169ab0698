"""The cloud side: Compute Engine VMs and their lifecycle, SSH, checks before spending, the TPU VM's lock, xpk on GKE."""
