"""What the client library and the node both speak: the error catalog (`errors`), the client
WebSocket's frame codec (`protocol`) and the request signing scheme (`signing`).

Both sides import this package; it imports nothing else of the project (tests/test_layers.py).
"""
