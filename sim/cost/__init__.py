"""Cost models of the simulator: how long a forward takes, from the roofline or from a measured
latency profile, and what-if tools over them."""
