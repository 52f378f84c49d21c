"""Many GPUs and hosts: the server's replicas on Ray Serve, routed by image affinity.

Needs the ``cluster`` extra (Ray Serve). Map:
  affinity      a request's affinity key (its image, its adapter); cluster image ids
  ring          consistent hashing with bounded loads (pure)
  router        Ray Serve's request router over the ring
  replica       the deployment: the whole server on loopback, behind Ray's proxies
  http_forward  the replica's HTTP ingress, streamed on to its own HTTP door
  directory     a named actor that knows each replica's metrics endpoint
  metrics       every replica's metrics, each labelled, and their sums
  app           deployment options, the application, the Serve config file
  command       ``vlm cluster``
"""
