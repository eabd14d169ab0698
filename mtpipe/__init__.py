"""mtpipe: MaxText post-training tutorials as a DVC pipeline wrapped by doit tasks."""
