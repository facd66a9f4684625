"""The sequence-aware trigger: admits pre-inference only for requests at risk of missing the
ranking SLO, within per-instance bounds on resident psi bytes and pre-inference load."""
