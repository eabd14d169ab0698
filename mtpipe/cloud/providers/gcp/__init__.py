"""Google Compute Engine as a provider: its calls, bodies and errors, Google's other APIs, SSH route, idle watch."""
