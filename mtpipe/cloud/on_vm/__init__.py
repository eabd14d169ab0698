"""What runs on the VM: SSH to it, its setup, the pipeline as DVC experiments (and their `dvc exp run`), where a run is."""
