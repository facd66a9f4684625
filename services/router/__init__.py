"""The affinity-aware router: one placement per user for its pre-infer signal and its ranking call.

* `placement.preference`: rendezvous hashing with a load bound and per-user random tie-breaks; a
  pure function that every router replica (and the trigger) computes identically.
* `membership.Membership`: health-checked ranker targets, one gRPC channel each, with load figures.
* `residency.ResidencyMap`: where an accepted pre-inference went, preferred for the ranking call
  while its lease lasts.
* `service.RouterService`: the Ranker gRPC API as a front door (retries on the next instance in
  preference order) and the Kafka consumer that forwards PreInferSignals.

Run: `python -m services.router --rankers host:port,host:port [flags]` (see config.RouterConfig).
"""
