//! [`TcpGroup`]: ranks as processes (on one machine or many) over TCP.
//!
//! Every pair of ranks holds one connection (a full mesh, set up through the rendezvous
//! store); a reader thread per connection files arriving messages into the rank's mailbox, so
//! sends never wait on the receiver. The ring algorithms of [`ProcessGroup`] then move
//! `2 (N-1)/N` of an all-reduce's buffer per rank. A full mesh suits the tens of CPU ranks this
//! transport is for; GPU jobs use NCCL.

use crate::env::LaunchEnv;
use crate::error::{CommError, Result};
use crate::group::{GroupCore, GroupOptions, delegate_process_group};
use crate::store::{StoreClient, StoreServer};
use crate::transport::{FailureNote, Header, Lane, Mailbox, Message, Transport};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const HELLO_MAGIC: u32 = 0x4b49_4c4e; // "KILN"
const PROTOCOL_VERSION: u32 = 2;

#[derive(Debug)]
struct TcpTransport {
    rank: usize,
    world_size: usize,
    /// Write halves, by peer rank (`None` for this rank).
    peers: Vec<Option<Mutex<TcpStream>>>,
    mailbox: Arc<Mailbox>,
    failure: FailureNote,
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn kind(&self) -> &'static str {
        "tcp"
    }
    fn send(&self, dst: usize, header: Header, payload: &[u8]) -> Result<(), String> {
        if dst == self.rank {
            let payload = self.mailbox.pool().copy_of(payload);
            self.mailbox.push(dst, Message { header, payload });
            return Ok(());
        }
        let conn = self.peers[dst]
            .as_ref()
            .expect("a connection to every peer");
        let mut conn = conn
            .lock()
            .map_err(|_| "connection lock poisoned".to_string())?;
        // A write blocks when the peer stops reading (a peer that hangs): this rank then
        // waits on it, as in a receive (crate::progress).
        let _waiting = crate::progress::waiting();
        write_frame(&mut conn, &header.encode(), payload)
            .map_err(|e| format!("sending to rank {dst} failed: {e}"))
    }
    fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }
    fn note_failure(&self, reason: &str) {
        self.failure.set(reason);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Say why, then half-close: peers read what was sent, then the goodbye, then
        // end-of-stream.
        let reason = self.failure.leaving(self.rank).into_bytes();
        for conn in self.peers.iter().flatten() {
            if let Ok(mut conn) = conn.lock() {
                let header = Header {
                    group: 0,
                    lane: Lane::Goodbye,
                    kind: crate::OpKind::Barrier,
                    dtype: crate::DType::I64,
                    op: 0,
                    root: 0,
                    seq: 0,
                    total: 0,
                    step: 0,
                    payload_len: reason.len() as u64,
                };
                let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = conn.write_all(&header.encode());
                let _ = conn.write_all(&reason);
                let _ = conn.shutdown(Shutdown::Write);
            }
        }
    }
}

/// Writes a header and its payload straight from the caller's buffer, in one system call when
/// the socket takes it all: with `TCP_NODELAY` a header written alone would go out as a
/// segment of its own.
fn write_frame(w: &mut TcpStream, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
    // `write`, not `write_vectored`: std sends with MSG_NOSIGNAL, while its `writev` would let
    // a peer that died raise SIGPIPE, which kills a rank silently where SIGPIPE is not ignored
    // (the `kiln` binary restores its default), instead of the named "lost rank" error.
    if payload.len() <= 64 << 10 {
        let mut frame = Vec::with_capacity(header.len() + payload.len());
        frame.extend_from_slice(header);
        frame.extend_from_slice(payload);
        w.write_all(&frame)
    } else {
        // Large: no copy; TCP_NODELAY keeps the header from waiting for an ACK.
        w.write_all(header)?;
        w.write_all(payload)
    }
}

/// Files the messages from `peer` into `mailbox` until the connection ends. Payloads are read
/// straight from the socket into pooled buffers (no intermediate buffering), which the
/// collective reduces from and hands back.
fn read_loop(peer: usize, mut stream: TcpStream, mailbox: Arc<Mailbox>) {
    let reason = loop {
        let mut hb = [0u8; Header::WIRE];
        if let Err(e) = stream.read_exact(&mut hb) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!("rank {peer} closed its connection (process exited or dropped its group)")
            } else {
                format!("connection to rank {peer} failed: {e}")
            };
        }
        let header = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => break format!("from rank {peer}: {e}"),
        };
        let mut payload = mailbox.pool().take(header.payload_len as usize);
        if let Err(e) = stream.read_exact(payload.as_mut()) {
            break format!("connection to rank {peer} failed mid-message: {e}");
        }
        if header.lane == Lane::Goodbye {
            break String::from_utf8_lossy(&payload).into_owned();
        }
        mailbox.push(peer, Message { header, payload });
    };
    mailbox.close(peer, reason);
}

/// One rank's handle on a group of processes connected over TCP.
#[derive(Debug)]
pub struct TcpGroup {
    core: GroupCore,
    store: Arc<StoreClient>,
    /// Rank 0 hosts the store for as long as the group lives.
    _server: Option<Arc<StoreServer>>,
}

impl TcpGroup {
    /// Joins the job described by the environment ([`LaunchEnv::from_env`]); rank 0 hosts the
    /// rendezvous store on `MASTER_PORT`.
    ///
    /// # Errors
    /// Missing or inconsistent variables, a port in use, a rank that never arrives.
    pub fn from_env() -> Result<TcpGroup> {
        Self::from_launch_env(&LaunchEnv::from_env()?, GroupOptions::default())
    }

    /// Joins the job described by `env`.
    ///
    /// # Errors
    /// As [`TcpGroup::from_env`].
    pub fn from_launch_env(env: &LaunchEnv, options: GroupOptions) -> Result<TcpGroup> {
        // Under `kiln launch`: the heartbeat its hang detection reads.
        crate::progress::start_from_env();
        let (server, store) = env.rendezvous(options.timeout)?;
        let mut group = Self::connect(store, env.rank, env.world_size, options)?;
        group._server = server;
        Ok(group)
    }

    /// Connects `world_size` ranks through an existing store. Every rank calls it with its own
    /// `rank`; keys are prefixed with `options.name`, so one store can set up several groups.
    ///
    /// # Errors
    /// A rank claimed twice, world sizes that disagree, a peer that never connects.
    pub fn connect(
        store: Arc<StoreClient>,
        rank: usize,
        world_size: usize,
        options: GroupOptions,
    ) -> Result<TcpGroup> {
        let prefix = format!("kiln/tcp/{}/", options.name);
        let key = |k: &str| format!("{prefix}{k}");
        let setup = |m: String| CommError::Setup(format!("rank {rank} of {world_size}: {m}"));
        if rank >= world_size {
            return Err(setup(format!("rank {rank} is out of range")));
        }
        if store.add(&key(&format!("claim/{rank}")), 1)? != 1 {
            return Err(setup(format!(
                "rank {rank} was claimed by two processes (check RANK / --node-rank)"
            )));
        }
        if rank == 0 {
            store.set(&key("world_size"), world_size.to_string().as_bytes())?;
        }
        let theirs = String::from_utf8_lossy(&store.get(&key("world_size"))?).into_owned();
        if theirs != world_size.to_string() {
            return Err(setup(format!(
                "world size mismatch: this rank was started with WORLD_SIZE={world_size} but rank 0 \
                 with WORLD_SIZE={theirs}"
            )));
        }

        let ip = store.local_ip()?;
        let listener = TcpListener::bind((ip, 0)).map_err(|e| CommError::Io {
            context: format!("rank {rank}: listening on {ip}"),
            source: e,
        })?;
        let me = listener.local_addr().map_err(|e| CommError::Io {
            context: "listener address".into(),
            source: e,
        })?;
        store.set(&key(&format!("addr/{rank}")), me.to_string().as_bytes())?;

        let deadline = Instant::now() + options.timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        // Lower ranks accept, higher ranks connect: each pair connects exactly once.
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let addr =
                String::from_utf8_lossy(&store.get(&key(&format!("addr/{peer}")))?).into_owned();
            let stream = connect_until(&addr, deadline)
                .map_err(|e| setup(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
            // The job token first, proven (crate::auth) with the hello bound to the proof: a
            // peer refuses (and logs) a connection that cannot prove it.
            let mut hello = Vec::with_capacity(16);
            for v in [
                HELLO_MAGIC,
                PROTOCOL_VERSION,
                rank as u32,
                world_size as u32,
            ] {
                hello.extend_from_slice(&v.to_le_bytes());
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1));
            stream
                .set_read_timeout(Some(wait))
                .and_then(|()| stream.set_write_timeout(Some(wait)))
                .map_err(|e| setup(format!("connection to rank {peer}: {e}")))?;
            crate::auth::connect(&mut &stream, &mut &stream, store.token(), &hello)
                .map_err(|e| setup(format!("handshake with rank {peer} at {addr}: {e}")))?;
            stream
                .set_read_timeout(None)
                .map_err(|e| setup(format!("connection to rank {peer}: {e}")))?;
            *slot = Some(stream);
        }
        listener.set_nonblocking(true).map_err(|e| CommError::Io {
            context: "listener".into(),
            source: e,
        })?;
        let mut pending = world_size - 1 - rank;
        while pending > 0 {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream.set_nonblocking(false).map_err(|e| CommError::Io {
                        context: "accepted connection".into(),
                        source: e,
                    })?;
                    let peer = match read_hello(&stream, world_size, deadline, store.token()) {
                        Ok(peer) => peer,
                        // Not this job's: logged and dropped, the job goes on forming.
                        Err(Hello::Refused(why)) => {
                            eprintln!("kiln: rank {rank} refused a connection from {from}: {why}");
                            continue;
                        }
                        Err(Hello::Bad(e)) => {
                            return Err(setup(format!("connection from {from}: {e}")));
                        }
                    };
                    if peer <= rank || streams[peer].is_some() {
                        return Err(setup(format!("unexpected connection from rank {peer}")));
                    }
                    streams[peer] = Some(stream);
                    pending -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (rank + 1..world_size)
                            .filter(|p| streams[*p].is_none())
                            .collect();
                        return Err(setup(format!(
                            "timed out after {:?} waiting for ranks {missing:?} to connect",
                            options.timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(setup(format!("accept failed: {e}"))),
            }
        }

        let mailbox = Arc::new(Mailbox::default());
        let mut peers = Vec::with_capacity(world_size);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                peers.push(None);
                continue;
            };
            let io = |e| CommError::Io {
                context: format!("configuring the connection to rank {peer}"),
                source: e,
            };
            stream.set_nodelay(true).map_err(io)?;
            socket_buffers(&stream);
            // A peer that stops reading (hung, not dead) must not block this rank forever.
            stream
                .set_write_timeout(Some(options.timeout))
                .map_err(io)?;
            let reader = stream.try_clone().map_err(io)?;
            let mb = mailbox.clone();
            std::thread::Builder::new()
                .name(format!("kiln-tcp-recv-{peer}"))
                .spawn(move || read_loop(peer, reader, mb))
                .map_err(|e| CommError::Io {
                    context: "spawning a reader thread".into(),
                    source: e,
                })?;
            peers.push(Some(Mutex::new(stream)));
        }
        let transport = Arc::new(TcpTransport {
            rank,
            world_size,
            peers,
            mailbox,
            failure: FailureNote::default(),
        });
        let group = TcpGroup {
            core: GroupCore::world(transport, options),
            store,
            _server: None,
        };
        crate::ProcessGroup::barrier(&group)?;
        Ok(group)
    }

    /// The rendezvous store this group was set up through.
    pub fn store(&self) -> &Arc<StoreClient> {
        &self.store
    }

    fn from_core(core: GroupCore, parent: &Self) -> Self {
        TcpGroup {
            core,
            store: parent.store.clone(),
            _server: parent._server.clone(),
        }
    }
}

delegate_process_group!(TcpGroup);

/// Socket buffers for bulk transfer: `KILN_COMM_SOCKBUF_KIB` sets both SO_SNDBUF and
/// SO_RCVBUF (the kernel caps them at net.core.{w,r}mem_max); unset, the kernel autotunes.
fn socket_buffers(stream: &TcpStream) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        unsafe extern "C" {
            fn setsockopt(fd: i32, level: i32, name: i32, value: *const u8, len: u32) -> i32;
        }
        const SOL_SOCKET: i32 = 1;
        const SO_SNDBUF: i32 = 7;
        const SO_RCVBUF: i32 = 8;
        let Some(kib) = std::env::var("KILN_COMM_SOCKBUF_KIB")
            .ok()
            .and_then(|v| v.trim().parse::<i32>().ok())
        else {
            return;
        };
        let bytes: i32 = kib.saturating_mul(1024);
        for name in [SO_SNDBUF, SO_RCVBUF] {
            // SAFETY: a valid socket and a pointer to an int of the length given.
            unsafe {
                setsockopt(
                    stream.as_raw_fd(),
                    SOL_SOCKET,
                    name,
                    (&bytes as *const i32).cast(),
                    4,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = stream;
}

fn connect_until(addr: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    let target: SocketAddr = addr
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e}")))?;
    loop {
        match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Why a connecting peer was not taken.
enum Hello {
    /// Not this job's (no token, another token, not kiln): refused, and the job goes on.
    Refused(String),
    /// This job's, but inconsistent (another protocol version or world size): an error.
    Bad(String),
}

fn read_hello(
    stream: &TcpStream,
    world_size: usize,
    deadline: Instant,
    token: Option<&str>,
) -> Result<usize, Hello> {
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100))
        .min(Duration::from_secs(10));
    stream
        .set_read_timeout(Some(wait))
        .map_err(|e| Hello::Bad(e.to_string()))?;
    let b = crate::auth::accept(&mut &*stream, &mut &*stream, token, 16).map_err(Hello::Refused)?;
    stream
        .set_read_timeout(None)
        .map_err(|e| Hello::Bad(e.to_string()))?;
    let word = |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
    if word(0) != HELLO_MAGIC {
        return Err(Hello::Refused("not a kiln peer (bad hello)".into()));
    }
    if word(1) != PROTOCOL_VERSION {
        return Err(Hello::Bad(format!(
            "protocol version {} but this rank speaks {PROTOCOL_VERSION}",
            word(1)
        )));
    }
    if word(3) as usize != world_size {
        return Err(Hello::Bad(format!(
            "peer rank {} has world size {} but this rank has {world_size}",
            word(2),
            word(3)
        )));
    }
    let peer = word(2) as usize;
    if peer >= world_size {
        return Err(Hello::Bad(format!("peer rank {peer} out of range")));
    }
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ProcessGroup;

    /// A connection without the job token, arriving while the job forms, is refused (and
    /// logged); the job forms anyway and its collectives work.
    #[test]
    fn peers_refuse_connections_without_the_job_token() {
        let server = StoreServer::bind_with_token("127.0.0.1:0", Some("tok".into())).unwrap();
        let addr = server.local_addr().to_string();
        let options = GroupOptions {
            timeout: Duration::from_secs(20),
            ..Default::default()
        };
        let join = |rank: usize| {
            let (addr, options) = (addr.clone(), options.clone());
            std::thread::spawn(move || {
                let store =
                    StoreClient::connect_with_token(&addr, options.timeout, Some("tok")).unwrap();
                let group = TcpGroup::connect(Arc::new(store), rank, 2, options).unwrap();
                let mut v = [rank as f32 + 1.0];
                group
                    .all_reduce((&mut v[..]).into(), crate::ReduceOp::Sum)
                    .unwrap();
                v[0]
            })
        };
        let rank0 = join(0);
        // Rank 0 is listening: a stranger with another job's token calls first, with a
        // hello that claims rank 1. Taken, it would stand in for rank 1, and the real rank 1
        // would be refused as a second rank 1.
        let probe = StoreClient::connect_with_token(&addr, options.timeout, Some("tok")).unwrap();
        let at = String::from_utf8(probe.get("kiln/tcp/world/addr/0").unwrap()).unwrap();
        let mut stray = TcpStream::connect(&at).unwrap();
        let mut hello = Vec::new();
        for v in [HELLO_MAGIC, PROTOCOL_VERSION, 1, 2] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        // Its handshake, with a proof made with its token (rank 0's proof, of this job's
        // token, fails its check in turn).
        let err = crate::auth::connect(&mut &stray, &mut &stray, Some("not-this-job"), &hello)
            .unwrap_err();
        assert!(err.contains("could not prove this job's token"), "{err}");
        // Refused: rank 0 closes the connection without a word (a reset when it leaves the
        // hello unread).
        let mut rest = Vec::new();
        match stray.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty()),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
        }
        let rank1 = join(1);
        assert_eq!(rank0.join().unwrap(), 3.0);
        assert_eq!(rank1.join().unwrap(), 3.0);
    }

    /// What a connector writes, recorded on the way (a process reading the job's traffic).
    struct Recorder<'a> {
        inner: &'a TcpStream,
        seen: Vec<u8>,
    }

    impl Write for Recorder<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.seen.extend_from_slice(buf);
            self.inner.write_all(buf).map(|()| buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.inner.flush()
        }
    }

    /// Rank 1's genuine handshake, captured and replayed byte for byte on a new connection, is
    /// refused: the proof answered the nonce of the first connection, not the one rank 0 draws
    /// for the replay.
    #[test]
    fn a_replayed_peer_handshake_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let mut hello = Vec::new();
        for v in [HELLO_MAGIC, PROTOCOL_VERSION, 1, 2] {
            hello.extend_from_slice(&v.to_le_bytes());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let genuine = std::thread::spawn(move || {
            let s = TcpStream::connect(at).unwrap();
            let mut rec = Recorder {
                inner: &s,
                seen: Vec::new(),
            };
            crate::auth::connect(&mut &s, &mut rec, Some("tok"), &hello).unwrap();
            rec.seen
        });
        let (s, _) = listener.accept().unwrap();
        assert!(matches!(read_hello(&s, 2, deadline, Some("tok")), Ok(1)));
        let captured = genuine.join().unwrap();
        let mut replay = TcpStream::connect(at).unwrap();
        replay.write_all(&captured).unwrap();
        let (s, _) = listener.accept().unwrap();
        match read_hello(&s, 2, deadline, Some("tok")) {
            Err(Hello::Refused(why)) => assert!(why.contains("replayed"), "{why}"),
            Ok(peer) => panic!("the replay was taken as rank {peer}"),
            Err(Hello::Bad(e)) => panic!("not refused as a stranger: {e}"),
        }
    }
}
