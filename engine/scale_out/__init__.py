"""Scale-out: the engine on a thread (`engine_thread`), one replica per GPU as a Ray actor
(`ray_replica`), and `ReplicaPool`, which spreads a job over them (`ray_data`). The Ray modules
need `pagedctl[ray]`; this one imports no Ray, so that a caller can name its error without it.
"""


class ClusterUnavailable(RuntimeError):
    """Ray could not start or join the cluster a `ReplicaPool` was given, or run on it: the
    cluster's state, not the settings, so a later try may succeed. The message is Ray's."""
