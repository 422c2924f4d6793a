"""One running app per home folder.

The first start holds a lock file in the data folder (QLockFile: a lock left by a crashed app is taken over,
since its process is gone) and listens on a local socket whose name comes from the data folder's path. A
second start on the same home sends its command-line files there, one JSON line, and exits; the first
brings its window to the front and opens them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from .paths import FolderError

log = logging.getLogger(__name__)

LOCK_FILENAME = "kvboost-desktop.lock"
_REPLY = b"ok\n"


def server_name(data_dir: Path) -> str:
    """The local socket's name for a data folder: the same for every start on it, different across homes."""
    digest = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
    return f"kvboost-desktop-{digest}"


class SingleInstance(QObject):
    files_received = Signal(list)  # absolute paths from a second start (maybe empty: just come to the front)

    def __init__(self, data_dir: Path, parent: QObject | None = None):
        super().__init__(parent)
        self.lock_path = Path(data_dir) / LOCK_FILENAME
        self.name = server_name(data_dir)
        self._lock = QLockFile(str(self.lock_path))
        self._lock.setStaleLockTime(0)  # held for the app's whole life: stale only once its process is gone
        self._server: QLocalServer | None = None
        self._buffers: dict[QLocalSocket, bytes] = {}

    def acquire(self) -> bool:
        """True: this is the only app on the home and now listens for later starts; False: another one runs."""
        if not self._lock.tryLock(0):
            if self._lock.error() == QLockFile.LockError.LockFailedError:
                return False
            raise FolderError(f"cannot create the lock file {self.lock_path} ({self._lock.error().name})")
        QLocalServer.removeServer(self.name)  # a crashed app's socket file; no one else holds the lock
        self._server = QLocalServer(self)
        self._server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not self._server.listen(self.name):
            log.warning("cannot listen on %s (%s): a second start will not reach this one", self.name,
                        self._server.errorString())
        self._server.newConnection.connect(self._on_new_connection)
        return True

    def release(self) -> None:
        if self._server is not None:
            self._server.close()
        self._lock.unlock()

    def send(self, files: list[str], timeout: float = 10.0) -> bool:
        """From a second start: hand `files` to the running app; True once it confirmed.

        Retries while the first app is still starting (it takes the lock before it listens)."""
        message = json.dumps({"files": files}).encode() + b"\n"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            socket = QLocalSocket()
            socket.connectToServer(self.name)
            if socket.waitForConnected(1000):
                socket.write(message)
                socket.waitForBytesWritten(1000)
                reply = b""
                while _REPLY not in reply and socket.waitForReadyRead(_ms_until(deadline)):
                    reply += bytes(socket.readAll())
                socket.disconnectFromServer()
                return _REPLY in reply
            time.sleep(0.2)
        return False

    def _on_new_connection(self) -> None:  # the first app: a later start connected
        while self._server.hasPendingConnections():
            socket = self._server.nextPendingConnection()
            self._buffers[socket] = b""
            socket.readyRead.connect(lambda socket=socket: self._on_ready_read(socket))
            socket.disconnected.connect(lambda socket=socket: self._forget(socket))

    def _on_ready_read(self, socket: QLocalSocket) -> None:
        self._buffers[socket] = self._buffers.get(socket, b"") + bytes(socket.readAll())
        line, newline, _ = self._buffers[socket].partition(b"\n")
        if not newline:
            return
        try:
            files = [str(f) for f in json.loads(line)["files"]]
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignored a malformed message on %s: %r (%s)", self.name, line[:200], exc)
            socket.disconnectFromServer()
            return
        socket.write(_REPLY)
        socket.flush()
        self.files_received.emit(files)

    def _forget(self, socket: QLocalSocket) -> None:
        self._buffers.pop(socket, None)
        socket.deleteLater()


def _ms_until(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))
