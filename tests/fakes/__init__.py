"""Stand-ins for the services the tests talk to: fake APIs, servers on 127.0.0.1, fake executables."""
