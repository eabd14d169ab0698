"""The VM's settings: conf/vm.yaml and its environment, the state file, the prices."""
