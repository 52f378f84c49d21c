"""Many GPUs and hosts: the server's replicas on Ray Serve, routed by image affinity.

Needs the ``cluster`` extra (Ray Serve) for the replicas; the gateway's modules do not import
Ray. Map:
  affinity         a request's affinity key (its image, its adapter); cluster image ids
  http_keys        the same keys read from HTTP bodies
  ring             consistent hashing, the load guard, which replicas hold each key (pure)
  replica_set      the gateway's replicas, their work in flight, routing (pure)
  shared_loads     the gateway workers' work in flight, in memory they all map
  gateway_grpc     the gateway's gRPC door: the API passed on as bytes
  gateway_http     the gateway's HTTP door
  gateway          both doors, following the directory and the replicas' health
  gateway_workers  gateway processes sharing the ports
  router           Ray Serve's request router over the ring (--ingress ray)
  replica          the deployment: the whole server, its own doors on the node's address
  http_forward     the replica's HTTP ingress behind Ray's proxy (--ingress ray)
  directory        a named actor that knows each replica's doors and metrics
  metrics          every replica's metrics, each labelled, and their sums
  autoscaling      Ray Serve's autoscaling policy on the replicas' own in-flight counts
  app              deployment options, the application, the Serve config file
  command          ``vlm cluster`` and ``vlm gateway``
"""
