"""What every HTTP front (server and router) shares about callers: credentials, body and header guards, tenants, their limits and classes, the waiting room, traces."""
