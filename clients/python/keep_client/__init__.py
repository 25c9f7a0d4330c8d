"""KEEP's Python client: what an embodied agent written in Python uses to keep its memory at
keep-manager and ask keep-worker for plans (Cap'n Proto over ZeroMQ; proto/, docs/protocol.md).

    from keep_client import ManagerClient, WorkerClient
    m = ManagerClient("tcp://127.0.0.1:7601")
    m.write("robot1", "The milk is in the fridge.", kind="object_state")
    w = WorkerClient("tcp://127.0.0.1:7602")
    print(w.complete("robot1", "Bring me the milk.", method="keep").text)
"""
from . import errors
from .errors import KeepError
from .manager import ManagerClient, Memory, Segment, Written
from .worker import Completion, Scored, Stats, WorkerClient

__all__ = ["ManagerClient", "WorkerClient", "KeepError", "errors", "Written", "Segment", "Memory",
           "Completion", "Scored", "Stats"]
