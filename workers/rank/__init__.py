"""A rank of the pool: start-up and census (process.py), rank 0's client server (server.py) and its checks
(validation.py), the job loop (loop.py) that runs each job (runner.py) as rank 0 broadcast it (work.py), and
the status (status.py)."""
