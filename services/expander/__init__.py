"""The memory-aware expander: a per-host daemon keeping demoted psi in one shared host-DRAM arena.

Rankers demote a user's psi into the arena (reserve, copy, commit) and reload it when the user
returns (acquire, copy, release); only offsets and lengths cross the control socket. Modules:
`store` (the entry state machine), `allocator` (page-aligned first fit), `arena` (the memfd the
daemon owns), `server` (the daemon), `config` (its settings). What clients share with the daemon
(the protocol, the entry types, the arena mapping, the async client) is in shared/expander/: a
client never imports this package. Run the daemon with `python -m services.expander --help`.
"""
