"""`+calibrate`: measuring this machine for `sim.cost_model=profile` (the latency tables, message
costs, contention, tree overhead) and the short forward probe every run records."""
