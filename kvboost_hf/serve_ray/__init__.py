"""The OpenAI-compatible server as a Ray Serve application: engine replicas behind an ingress that routes by chunk
keys (``pip install kvboost_hf[ray]``). Run it with ``python -m kvboost_hf.serve_ray``; the parts:
:mod:`.routing` (keys, prefix table, ranking; no Ray), :mod:`.routers` (Ray Serve request routers), :mod:`.app`
(deployments) and :mod:`.launch` (flags)."""
