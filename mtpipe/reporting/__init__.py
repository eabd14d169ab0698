"""What a run tells people: the offline plots page (`dvc plots show`) and the run report (`make demo`)."""
