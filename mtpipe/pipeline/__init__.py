"""The pipeline side: resolved configuration (params.yaml + conf/), its schema, `-S` overrides, what every stage shares, DVC metrics and plots."""
