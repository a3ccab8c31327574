"""Running a simulated experiment: the SimPy pass over the requests, its links, pipeline and
topology, and prediction intervals."""
