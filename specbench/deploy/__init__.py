"""The client-server deployment's parts that do not depend on the engine (MoA paper section 4.2, appendix A.2; issue 78):
`link` (a seeded user-space emulation of a 5G/4G link on the TCP send path), `protocol` (the versioned binary
messages: hello, the client's tree, the server's answer with 8-bit activations), `tcp` (framing over a real socket,
the handshake, one-line errors for a port in use and a peer gone). The split itself (server and client processes over
the engine) is not built yet: docs/deploy.md. Imports nothing of specbench but `errors`.
"""
