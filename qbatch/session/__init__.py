"""qbatch from Python: a warm Session, a one-call run(), and a LangChain chat model (langchain.py)."""

from qbatch.session.session import Reply, RunResult, Session, run

__all__ = ["Reply", "RunResult", "Session", "run"]
