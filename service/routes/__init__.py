"""Routers, one module per resource; ``service.main`` assembles them."""
