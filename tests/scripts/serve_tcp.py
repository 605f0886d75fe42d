"""A job that serves TCP on 127.0.0.1:PORT inside its own sandbox until it is cancelled
(tests/integration/test_exec.py forwards to it): it says `ready`, then each line it gets comes
back as `echo:LINE`. It prints nothing: a quiet job, so nothing but exec touches its logs."""

import socket
import sys
import threading

port = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", port))


def serve(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as stream:
        stream.write(b"ready\n")  # it speaks first, as SSH or a database would
        stream.flush()
        for line in stream:
            stream.write(b"echo:" + line)
            stream.flush()


while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
