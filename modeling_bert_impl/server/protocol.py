"""What uvicorn does not bound: a request's head (its request line and headers), in bytes, in lines and in time.

`guarded_protocol(limits)` is uvicorn's own HTTP protocol (httptools' where it is installed, else h11's) with a guard
on the bytes that come before each request's blank line: past `max_header_bytes` or `max_headers` lines the client
gets 431, and a head not complete `header_timeout` seconds after its first byte (or, on a new connection, after the
connection) gets 408; either closes the connection, before anything of the request reaches the app. Everything
else is uvicorn's. The body's own limits (its size, its time) are the app's (app.py, `read_body`).
"""

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEAD_END = b"\r\n\r\n"


def guarded_protocol(limits, base: type = AutoHTTPProtocol) -> type:
    """uvicorn's protocol class `base` with `limits`' guard on each request's head (`Limits.max_header_bytes`,
    `.max_headers`, `.header_timeout`)."""

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_timer = None
            self.expect_head()
            self.start_head_timer()  # a connection that never sends is bounded too

        def expect_head(self) -> None:
            """The next bytes are a request's head: count them afresh."""
            self.in_head, self.head_bytes, self.head_lines, self.tail = True, 0, 0, b""

        def start_head_timer(self) -> None:
            self.head_timer = self.loop.call_later(limits.header_timeout, self.refuse, 408, "Request Timeout",
                                                   f"the request's headers did not arrive within "
                                                   f"{limits.header_timeout:g} s (--header-timeout)")

        def stop_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def data_received(self, data: bytes) -> None:
            if self.in_head:
                if self.head_timer is None:
                    self.start_head_timer()
                seen = self.tail + data
                end = seen.find(HEAD_END)
                head = seen if end < 0 else seen[:end + len(HEAD_END)]
                self.head_bytes += len(head) - len(self.tail)
                self.head_lines += head.count(b"\r\n") - self.tail.count(b"\r\n")
                if self.head_bytes > limits.max_header_bytes or self.head_lines > limits.max_headers + 2:
                    return self.refuse(431, "Request Header Fields Too Large",
                                       f"the request's headers exceed {limits.max_header_bytes} bytes or "
                                       f"{limits.max_headers} fields (--max-header-bytes, --max-headers)")
                if end < 0:
                    self.tail = seen[-(len(HEAD_END) - 1):]
                else:
                    self.in_head = False
                    self.stop_head_timer()
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.expect_head()  # its timer starts with its first byte: until then uvicorn's keep-alive bounds it

        def connection_lost(self, exc) -> None:
            self.stop_head_timer()
            super().connection_lost(exc)

        def refuse(self, status: int, reason: str, message: str) -> None:
            """Answer `status` in text-embeddings-inference's error shape and close the connection."""
            self.stop_head_timer()
            if self.transport.is_closing():
                return
            body = b'{"error":"%s","error_type":"Validation"}' % message.encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (status, reason.encode(), len(body), body))
            self.transport.close()

    return GuardedProtocol
