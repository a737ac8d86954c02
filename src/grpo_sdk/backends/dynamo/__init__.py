"""NVIDIA Dynamo generation backend: a client of a running Dynamo deployment (docs/dynamo.md).

Generation through the deployment's OpenAI-compatible frontend, weights through its vLLM workers'
system routes. Tested here against a stand-in over real HTTP (tests/engine_servers/dynamo_server.py);
it has not run against a real Dynamo deployment.
"""
