"""The fleet control service (`rlfleet control`), divided as the frontends divide a dialect:
`service` (FleetControl: the fleet operations and their journal), one route module per
dialect (`vllm`, `sglang`, `areal`, `smg`, `skyrl`: thin handlers that read the request,
call the service and answer in the dialect's shapes), `bodies` (how a route reads its
body) and `app` (the HTTP app binding every route of rlfleet.protocol.fleet_control to its
handler, and `serve`)."""
