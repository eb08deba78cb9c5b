"""What clients reach: REST, the WebSocket, authentication and grants."""
