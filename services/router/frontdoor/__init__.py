"""The router's public port as an HTTP/2 frame relay (RELAYGR_ROUTER_FRONT_DOOR=relay).

`relay` serves Rank with the router's placement and passes every other stream through to the
router's own gRPC server; `h2wire` is the frame layer (frames, flow control, limits), `h2headers`
the HPACK decoder that keeps a connection alive past one stream's oversized header list. Header
blocks are this package's business: the router hands it a method path and message bytes.
"""

from services.router.frontdoor.h2wire import H2_ERROR_NAMES
from services.router.frontdoor.relay import FrontDoor, FrontDoorError, RelayReply, Upstream, UpstreamPool

__all__ = ["H2_ERROR_NAMES", "FrontDoor", "FrontDoorError", "RelayReply", "Upstream", "UpstreamPool"]
