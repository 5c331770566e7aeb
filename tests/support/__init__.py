"""What several test modules share, one module per subject. Fixtures stay in the conftest.py
files; a test module never imports another test module, it imports from here.

- `api_clients`: management API clients (a bearer token).
- `api_keys`: whether the gateway would accept a plaintext API key (its own auth path).
- `webhook_receiver`: an HTTP server on loopback that records the webhooks it is sent.
- `prometheus`: reading the /metrics page.
- `gateway_calls`: what an end-to-end call left behind (the usage stream, the mock's bill).
- `routes`: the /api/ and /console/ routes, read from Django's URL resolver.
"""
