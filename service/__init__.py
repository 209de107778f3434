"""paraseek service: FastAPI text-to-image search over a snapshot with a model bundle.

Runs on onnxruntime, faiss and numpy (no torch). ``paraseek.service.main.create_app`` assembles the app.
"""
