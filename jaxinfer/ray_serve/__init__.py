"""jaxinfer on Ray Serve (docs/RAY.md): ``jaxinfer serve-ray`` or ``serve run deploy/ray/serve_config.yaml``.

Modules: ``serve_ray`` (the command line and ``build_app`` for ``serve run``), ``config`` (``ModelSpec``,
``RayServeConfig``: every size derived from the engine's limits), ``application`` (the two
deployments, bound), ``ingress`` (the OpenAI routes of ``server.py``) over ``wsgi_bridge`` (the
Flask app as ASGI, disconnects included) and ``remote_client`` (the ingress's ``EngineClient``),
``engine_replica`` (one ``EngineLoop`` per replica), ``wire`` (what crosses between them),
``autoscaling`` (``QueueAutoscalingPolicy``), ``prefix_router`` (``PrefixAwareRouter``),
``batch_replica`` (the Batch API's runner deployment and the ingress's view of its store) and
``metrics`` (``/metrics`` merged over the replicas).

Importing this package does not import Ray; its modules do.
"""
