"""Routers, one module per resource; ``paraseek.service.main`` assembles them."""
