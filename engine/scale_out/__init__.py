"""Scale-out: the engine on a thread (`engine_thread`), one replica per GPU as a Ray actor
(`ray_replica`), and `ReplicaPool`, which spreads a job over them (`ray_data`). The Ray modules
need `pagedctl[ray]`.
"""
