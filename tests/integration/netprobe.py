"""Tiny TCP probes that testbed tests run inside namespaces: `python -m tests.integration.netprobe MODE ...`.

sink HOST PORT SECONDS   accept one connection, read SECONDS from its first byte, print the bytes read
source HOST PORT         connect and send zeros until the peer goes away
echo HOST PORT           echo every line back, to any number of connections
chat HOST PORT           connect; print "connected" (or "failed: why"), then send each stdin line
                         and print each line that comes back
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def sink(host: str, port: int, seconds: float) -> None:
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            total = len(conn.recv(65536))
            end = time.monotonic() + seconds
            conn.settimeout(1.0)
            while time.monotonic() < end:
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                total += len(data)
        print(total, flush=True)


def source(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=10) as s:
        block = bytes(65536)
        try:
            while True:
                s.sendall(block)
        except OSError:
            pass


def echo(host: str, port: int) -> None:
    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            for line in f:
                f.write(line)
                f.flush()

    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()


def chat(host: str, port: int) -> None:
    try:
        s = socket.create_connection((host, port), timeout=3)
    except OSError as e:
        print(f"failed: {e}", flush=True)
        return
    s.settimeout(None)
    print("connected", flush=True)
    f = s.makefile("rwb")

    def back() -> None:
        for line in f:
            sys.stdout.write(line.decode())
            sys.stdout.flush()

    threading.Thread(target=back, daemon=True).start()
    for line in sys.stdin:
        f.write(line.encode())
        f.flush()


if __name__ == "__main__":
    mode, host, port, *rest = sys.argv[1:]
    if mode == "sink":
        sink(host, int(port), float(rest[0]))
    elif mode == "source":
        source(host, int(port))
    elif mode == "echo":
        echo(host, int(port))
    else:
        chat(host, int(port))
