"""qbatch from Python: a warm Session, a one-call run(), and a LangChain chat model (langchain.py)."""

from qbatch.session.reply import Reply
from qbatch.session.result import RunResult
from qbatch.session.session import Session, run

__all__ = ["Reply", "RunResult", "Session", "run"]
