//! The rendezvous: a small TCP key-value store hosted by rank 0 of a job.
//!
//! Ranks publish their addresses (and the NCCL unique id) here and wait for each other's,
//! as torch's `TCPStore` does. Operations: [`set`](StoreClient::set),
//! [`get`](StoreClient::get) (waits until the key exists), [`add`](StoreClient::add)
//! (atomic counter), [`check`](StoreClient::check) and [`wait`](StoreClient::wait).
//!
//! Wire format (little endian): first the job token's challenge–response ([`crate::auth`]),
//! answered `status:u8 len:u64 bytes`; then requests `op:u8 key_len:u32 key val_len:u64 val
//! timeout_ms:u64`, each answered `status:u8 len:u64 bytes` (status 0 ok, 1 timed out, 2 error
//! text).
//!
//! The job token: a store given one ([`StoreServer::bind_with_token`], from `KILN_JOB_TOKEN`,
//! which `kiln launch` sets) serves only connections that prove they hold it (an HMAC of a nonce
//! the store draws for each connection, so replayed bytes are refused), and logs the others. It
//! proves itself to its clients the same way. The traffic is not encrypted.

use crate::error::{CommError, Result};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_DELETE: u8 = 5;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_ERROR: u8 = 2;

/// Keys and values are bounded so that a stray client cannot make the server allocate wildly.
const MAX_KEY: usize = 4 << 10;
const MAX_VALUE: usize = 64 << 20;

#[derive(Debug, Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// The store's server side; it serves until dropped.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    table: Arc<Table>,
}

impl StoreServer {
    /// Listens on `addr` (e.g. `0.0.0.0:29500`; port 0 picks a free port).
    ///
    /// # Errors
    /// [`CommError::Store`] if the address cannot be bound, e.g. the port is in use.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<StoreServer> {
        Self::bind_with_token(addr, None)
    }

    /// [`bind`](Self::bind) for a job with a token: connections that do not present `token`
    /// are refused, and each refusal is logged on stderr with the peer's address. `None`
    /// admits any connection.
    ///
    /// # Errors
    /// As [`bind`](Self::bind).
    pub fn bind_with_token(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: Option<String>,
    ) -> Result<StoreServer> {
        let token: Option<Arc<str>> = token.map(Into::into);
        let shown = format!("{addr:?}").trim_matches('"').to_string();
        let listener = TcpListener::bind(&addr).map_err(|e| CommError::Store {
            addr: shown.clone(),
            message: if e.kind() == std::io::ErrorKind::AddrInUse {
                "cannot host the rendezvous store: the port is already in use (another job, or \
                 a stale process?); choose another MASTER_PORT / --master-port"
                    .to_string()
            } else {
                format!("cannot host the rendezvous store: {e}")
            },
        })?;
        let addr = listener.local_addr().map_err(|e| CommError::Io {
            context: "store local address".into(),
            source: e,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let (stop2, table2) = (stop.clone(), table.clone());
        std::thread::Builder::new()
            .name("kiln-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (table, stop, token) = (table2.clone(), stop2.clone(), token.clone());
                    let _ = std::thread::Builder::new()
                        .name("kiln-store-conn".into())
                        .spawn(move || serve(conn, &table, &stop, token.as_deref()));
                }
            })
            .map_err(|e| CommError::Io {
                context: "spawning the store thread".into(),
                source: e,
            })?;
        Ok(StoreServer { addr, stop, table })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.table.changed.notify_all();
        // Wake the accept loop so it sees the flag.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

fn read_exact_vec(r: &mut impl Read, len: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn serve(conn: TcpStream, table: &Table, stop: &AtomicBool, token: Option<&str>) {
    let _ = conn.set_nodelay(true);
    let peer = conn
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    let Ok(read_half) = conn.try_clone() else {
        return;
    };
    let mut r = BufReader::new(read_half);
    let mut w = BufWriter::new(conn);
    let answer = |w: &mut BufWriter<TcpStream>, status: u8, body: &[u8]| {
        w.write_all(&[status])?;
        w.write_all(&(body.len() as u64).to_le_bytes())?;
        w.write_all(body)?;
        w.flush()
    };
    // A connection that never says anything keeps only its own thread.
    let _ = w.get_ref().set_read_timeout(Some(Duration::from_secs(60)));
    match crate::auth::accept(&mut r, &mut w, token, 0).map(drop) {
        Ok(()) => {
            if answer(&mut w, ST_OK, &[]).is_err() {
                return;
            }
        }
        Err(why) => {
            eprintln!("kiln: the rendezvous store refused a connection from {peer}: {why}");
            let _ = answer(
                &mut w,
                ST_ERROR,
                format!("the rendezvous store refused this process: {why}").as_bytes(),
            );
            let _ = w.get_ref().shutdown(Shutdown::Both);
            return;
        }
    }
    let _ = w.get_ref().set_read_timeout(None);
    let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut handle = || -> std::io::Result<()> {
        let mut op = [0u8; 1];
        r.read_exact(&mut op)?;
        let key_len = read_u32(&mut r)? as usize;
        if key_len > MAX_KEY {
            return Err(invalid("key too long"));
        }
        let key = String::from_utf8(read_exact_vec(&mut r, key_len)?)
            .map_err(|_| invalid("key is not UTF-8"))?;
        let val_len = read_u64(&mut r)? as usize;
        if val_len > MAX_VALUE {
            return Err(invalid("value too long"));
        }
        let val = read_exact_vec(&mut r, val_len)?;
        let timeout = Duration::from_millis(read_u64(&mut r)?);
        let (status, body) = match op[0] {
            OP_SET => {
                crate::lock(&table.map).insert(key, val);
                table.changed.notify_all();
                (ST_OK, Vec::new())
            }
            OP_GET => {
                let deadline = Instant::now() + timeout;
                let mut map = crate::lock(&table.map);
                loop {
                    if let Some(v) = map.get(&key) {
                        break (ST_OK, v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline || stop.load(Ordering::Acquire) {
                        break (ST_TIMEOUT, Vec::new());
                    }
                    map = table
                        .changed
                        .wait_timeout(map, (deadline - now).min(Duration::from_millis(500)))
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0;
                }
            }
            OP_ADD => {
                let delta = i64::from_le_bytes(
                    val.as_slice()
                        .try_into()
                        .map_err(|_| invalid("add needs 8 bytes"))?,
                );
                let mut map = crate::lock(&table.map);
                let cur = map
                    .get(&key)
                    .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                    .map_or(0, i64::from_le_bytes);
                let new = cur.wrapping_add(delta);
                map.insert(key, new.to_le_bytes().to_vec());
                drop(map);
                table.changed.notify_all();
                (ST_OK, new.to_le_bytes().to_vec())
            }
            OP_CHECK => {
                let present = crate::lock(&table.map).contains_key(&key);
                (ST_OK, vec![u8::from(present)])
            }
            OP_DELETE => {
                let present = crate::lock(&table.map).remove(&key).is_some();
                (ST_OK, vec![u8::from(present)])
            }
            other => (ST_ERROR, format!("unknown store op {other}").into_bytes()),
        };
        w.write_all(&[status])?;
        w.write_all(&(body.len() as u64).to_le_bytes())?;
        w.write_all(&body)?;
        w.flush()
    };
    while !stop.load(Ordering::Acquire) {
        if handle().is_err() {
            break;
        }
    }
    let _ = w.get_ref().shutdown(Shutdown::Both);
}

/// A connection to the rendezvous store.
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    conn: Mutex<TcpStream>,
    timeout: Duration,
    token: Option<String>,
}

impl StoreClient {
    /// Connects to the store at `addr` ("host:port"), retrying until `timeout` (rank 0 may not
    /// be listening yet).
    ///
    /// # Errors
    /// [`CommError::Store`] if the address does not resolve or nothing answers in time.
    pub fn connect(addr: &str, timeout: Duration) -> Result<StoreClient> {
        Self::connect_with_token(addr, timeout, None)
    }

    /// [`connect`](Self::connect), presenting the job token `token` (which the group's peers
    /// are then given too: [`token`](Self::token)).
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`CommError::Store`] when the store refuses the token.
    pub fn connect_with_token(
        addr: &str,
        timeout: Duration,
        token: Option<&str>,
    ) -> Result<StoreClient> {
        let deadline = Instant::now() + timeout;
        let store_err = |message: String| CommError::Store {
            addr: addr.to_string(),
            message,
        };
        let mut last = String::from("no attempt");
        loop {
            let targets: Vec<SocketAddr> = addr
                .to_socket_addrs()
                .map_err(|e| store_err(format!("cannot resolve the address: {e}")))?
                .collect();
            for target in &targets {
                match TcpStream::connect_timeout(target, Duration::from_secs(2)) {
                    Ok(mut conn) => {
                        let _ = conn.set_nodelay(true);
                        let io = |e: std::io::Error| {
                            store_err(format!("lost the connection to the store: {e}"))
                        };
                        conn.set_read_timeout(Some(timeout.max(Duration::from_secs(5))))
                            .map_err(io)?;
                        let proven = crate::auth::connect(&mut &conn, &mut &conn, token, &[]);
                        let mut status = [0u8; 1];
                        let answer = conn.read_exact(&mut status).and_then(|()| {
                            let len = (read_u64(&mut conn)? as usize).min(MAX_KEY);
                            read_exact_vec(&mut conn, len)
                        });
                        // The store's reason for a refusal first: it names this side's token.
                        match (answer, proven) {
                            (Ok(body), _) if status[0] != ST_OK => {
                                return Err(store_err(String::from_utf8_lossy(&body).into_owned()));
                            }
                            (_, Err(e)) => {
                                return Err(store_err(format!(
                                    "the rendezvous store failed the handshake: {e}"
                                )));
                            }
                            (Err(e), Ok(())) => return Err(io(e)),
                            (Ok(_), Ok(())) => {}
                        }
                        return Ok(StoreClient {
                            addr: addr.to_string(),
                            conn: Mutex::new(conn),
                            timeout,
                            token: token.map(str::to_string),
                        });
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(store_err(format!(
                    "could not reach the rendezvous store within {timeout:?} (last error: {last}); \
                     is rank 0 running and MASTER_ADDR/MASTER_PORT right?"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The address this client talks to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The job token this client presented, which its group's peers present to each other.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The local address of the connection: the interface through which this host reaches
    /// rank 0, which is the one to publish to peers.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        let conn = crate::lock(&self.conn);
        conn.local_addr()
            .map(|a| a.ip())
            .map_err(|e| CommError::Io {
                context: "store connection address".into(),
                source: e,
            })
    }

    fn request(&self, op: u8, key: &str, val: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        let store_err = |message: String| CommError::Store {
            addr: self.addr.clone(),
            message,
        };
        let mut conn = crate::lock(&self.conn);
        let io = |e: std::io::Error| store_err(format!("lost the connection to the store: {e}"));
        conn.set_read_timeout(Some(timeout + Duration::from_secs(5)))
            .map_err(io)?;
        let mut req = Vec::with_capacity(1 + 4 + key.len() + 8 + val.len() + 8);
        req.push(op);
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(val.len() as u64).to_le_bytes());
        req.extend_from_slice(val);
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        conn.write_all(&req).map_err(io)?;
        let mut status = [0u8; 1];
        conn.read_exact(&mut status).map_err(io)?;
        let len = read_u64(&mut *conn).map_err(io)? as usize;
        if len > MAX_VALUE {
            return Err(store_err("corrupt response".into()));
        }
        let body = read_exact_vec(&mut *conn, len).map_err(io)?;
        match status[0] {
            ST_OK => Ok(body),
            ST_TIMEOUT => Err(store_err(format!(
                "timed out after {timeout:?} waiting for key '{key}' (a rank did not arrive?)"
            ))),
            _ => Err(store_err(String::from_utf8_lossy(&body).into_owned())),
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(OP_SET, key, value, Duration::ZERO).map(drop)
    }

    /// The value of `key`, waiting up to the client's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.request(OP_GET, key, &[], self.timeout)
    }

    /// Adds `delta` to the counter `key` (0 if absent) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let body = self.request(OP_ADD, key, &delta.to_le_bytes(), Duration::ZERO)?;
        let bytes: [u8; 8] = body.as_slice().try_into().map_err(|_| CommError::Store {
            addr: self.addr.clone(),
            message: "corrupt add response".into(),
        })?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool> {
        Ok(self.request(OP_CHECK, key, &[], Duration::ZERO)? == [1])
    }

    /// Removes `key`; whether it was present.
    pub fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.request(OP_DELETE, key, &[], Duration::ZERO)? == [1])
    }

    /// Waits until every key in `keys` is set.
    pub fn wait(&self, keys: &[&str]) -> Result<()> {
        keys.iter().try_for_each(|k| self.get(k).map(drop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_check_wait() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let a = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
        let b = StoreClient::connect(&addr, Duration::from_secs(5)).unwrap();
        assert!(!a.check("k").unwrap());
        let waiter = std::thread::spawn(move || b.get("k").unwrap());
        std::thread::sleep(Duration::from_millis(50));
        a.set("k", b"v").unwrap();
        assert_eq!(waiter.join().unwrap(), b"v");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(a.add("n", 3).unwrap(), 5);
        a.wait(&["k", "n"]).unwrap();
        assert!(a.delete("k").unwrap());
        assert!(!a.check("k").unwrap());
    }

    #[test]
    fn get_of_a_missing_key_times_out_naming_it() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let c = StoreClient::connect(&server.local_addr().to_string(), Duration::from_millis(100))
            .unwrap();
        let err = c.get("never").unwrap_err().to_string();
        assert!(err.contains("'never'"), "{err}");
    }

    #[test]
    fn port_in_use_is_a_clear_error() {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let err = StoreServer::bind(server.local_addr())
            .unwrap_err()
            .to_string();
        assert!(err.contains("already in use"), "{err}");
    }

    #[test]
    fn unreachable_store_times_out() {
        // Bind then drop a listener to get a port nobody listens on.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let err = StoreClient::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(err.contains("could not reach"), "{err}");
    }

    #[test]
    fn a_store_with_a_job_token_admits_only_its_job() {
        let server = StoreServer::bind_with_token("127.0.0.1:0", Some("s3cret".into())).unwrap();
        let addr = server.local_addr().to_string();
        let t = Duration::from_secs(5);
        let ok = StoreClient::connect_with_token(&addr, t, Some("s3cret")).unwrap();
        ok.set("k", b"v").unwrap();
        assert_eq!(ok.token(), Some("s3cret"));
        let err = StoreClient::connect_with_token(&addr, t, Some("other"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("refused this process"), "{err}");
        assert!(err.contains("another job's token"), "{err}");
        let err = StoreClient::connect(&addr, t).unwrap_err().to_string();
        assert!(err.contains("presented no job token"), "{err}");
        // Something that is not kiln at all is refused too, and the store keeps serving.
        let mut stray = TcpStream::connect(&addr).unwrap();
        stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut reply = Vec::new();
        let _ = stray.read_to_end(&mut reply);
        assert_eq!(ok.get("k").unwrap(), b"v");
        // A store without a token admits any client.
        let open = StoreServer::bind("127.0.0.1:0").unwrap();
        StoreClient::connect_with_token(&open.local_addr().to_string(), t, Some("x")).unwrap();
    }

    /// A process that captured a client's handshake off the wire and replays it is refused:
    /// the store draws a fresh nonce for each connection, which the old proof does not answer.
    #[test]
    fn a_replayed_handshake_is_refused() {
        let server = StoreServer::bind_with_token("127.0.0.1:0", Some("s3cret".into())).unwrap();
        let store = server.local_addr();
        // A proxy that forwards a client to the store and records what the client sends.
        let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
        let via = proxy.local_addr().unwrap().to_string();
        let captured = Arc::new(Mutex::new(Vec::new()));
        let cap = captured.clone();
        std::thread::spawn(move || {
            let (mut client, _) = proxy.accept().unwrap();
            let mut upstream = TcpStream::connect(store).unwrap();
            let (mut back_from, mut back_to) =
                (upstream.try_clone().unwrap(), client.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut back_from, &mut back_to));
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = client.read(&mut buf) {
                cap.lock().unwrap().extend_from_slice(&buf[..n]);
                if upstream.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        });
        let t = Duration::from_secs(5);
        let genuine = StoreClient::connect_with_token(&via, t, Some("s3cret")).unwrap();
        genuine.set("k", b"v").unwrap();
        // The handshake: magic, flag and nonce (21 bytes), then the 32-byte proof.
        let handshake = captured.lock().unwrap()[..53].to_vec();
        let mut replay = TcpStream::connect(store).unwrap();
        replay.write_all(&handshake).unwrap();
        let mut reply = Vec::new();
        let _ = replay.read_to_end(&mut reply);
        let text = String::from_utf8_lossy(&reply);
        assert!(text.contains("refused this process"), "{text}");
        assert!(text.contains("replayed"), "{text}");
        // The genuine client goes on.
        assert_eq!(genuine.get("k").unwrap(), b"v");
    }
}
