"""How the pool's processes talk: framing (msgpack headers and raw tensor frames, no pickle), the typed messages
and their codec (client ↔ rank 0, rank 0 → ranks), the supervisor's control channel, CURVE keys and endpoints."""
