"""What the laptop checks and forecasts before any money is spent: preflight's compile, fit and cost
forecast, and the machine budget."""
