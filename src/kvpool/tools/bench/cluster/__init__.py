"""kvpool bench cluster: the whole system under a realistic workload."""
