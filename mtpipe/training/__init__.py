"""Where a training stage's MaxText run happens: this machine, or an xpk workload on a GKE slice, and
the workload's pod side; train_sft and train_rl run it."""
