from paraseek.cli import app

app()
