"""Scale-out on Ray: engine replicas as Ray actors behind one front door (docs/scale.md).

    client --ws/http--> StreamServer --> ClusterEngine (cluster.py) --route by session--> Replica actor
                                         placement.json (placement.py)                    (replica.py: one Engine,
                                         event pumps (fanin.py) <--long-poll events------  its ingest log, its feeds)

Importing this package (or anything in streamllm.service) never imports Ray: only
`cluster.ClusterEngine` does, when it is built (`streamllm serve --ray`). Install the
extra with `pip install 'streamllm[ray]'`.
"""
