"""The web console every node serves at /console/ (docs/CONSOLE.md): pages rendered on the node
from the templates beside this file, a little JavaScript from static/, nothing from the internet.

A signed-in browser acts as one registered client: the console makes its calls through the client
library in that client's name (delegated: qserver/api/auth.py), so it can never do more than the
client could with its own key. app.py holds the sign-in, the session cookie, the CSRF check, the
confirmation step of actions and the rendering; the pages live in pages_*.py, each adding its
routes through ConsoleRoutes.
"""
