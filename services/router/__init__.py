"""The affinity-aware router: one placement per user for its pre-infer signal and its ranking call.

* `service.RouterService`: the process (one lifecycle, shared/lifecycle.py) and the Ranker API's
  gRPC handlers;
* `forwarding.Forwarder`: placement (the residency map first, else rendezvous hashing with a load
  bound, shared/placement.py) and retries on the next instance in that order;
* `signals.SignalConsumer`: the Kafka consumer that forwards PreInferSignals as PreInfer calls;
* `residency.ResidencyMap`: where an accepted pre-inference went, preferred for the ranking call
  while its lease lasts;
* `stats`: the router's Stats answer; `metrics`: its Prometheus metrics;
* `frontdoor`: the HTTP/2 relays (hand-written, or on the h2 library) that own the public port
  when config.front_door names one (otherwise the gRPC server is the public port).

Membership (health-checked ranker targets) and placement live in shared/, as the trigger uses them
too. Nothing here imports torch.

Run: `python -m services.router --rankers host:port,host:port [flags]` (see config.RouterConfig).
"""
