//! The job token, proven rather than sent: a challenge–response with HMAC-SHA256.
//!
//! Every connection a job accepts (the rendezvous store's, each peer's in a [`TcpGroup`]
//! mesh, `kiln launch`'s own rendezvous) opens with this exchange, the connecting side `C`
//! and the accepting side `A` each sending a fresh 16-byte nonce:
//!
//! ```text
//! C -> A   "KLNH" has_token:u8 nonce_c[16]
//! A -> C   nonce_a[16] has_token:u8 HMAC(token, "kiln-auth accept" | nonce_c | nonce_a)
//! C -> A   HMAC(token, "kiln-auth connect" | nonce_a | nonce_c | bound) bound
//! ```
//!
//! `bound` is what the connector says next (a peer's hello: its rank and world size), so the
//! proof covers it. The token itself never crosses the wire, and each proof answers a nonce
//! the other side has just drawn: a process that captured a connection's bytes (on the job's
//! network, say) and replays them is asked another question and refused. The acceptor proves
//! the token too, so a connector also refuses a store or peer that is not the job's. This is
//! authentication, not encryption: the traffic after the handshake is in the clear.
//!
//! [`TcpGroup`]: crate::TcpGroup

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};

/// What a connection says first.
const MAGIC: [u8; 4] = *b"KLNH";
/// What kiln before the challenge–response said first (the token followed, in the clear).
const OLD_MAGIC: [u8; 4] = *b"KLNA";
const NONCE: usize = 16;
const MAC: usize = 32;

/// HMAC-SHA256 of the concatenated `parts` under `key` (RFC 2104).
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; MAC] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// A secret derived from the job token for one purpose (`label`), as hex: e.g. each restart of
/// a job gets its own, so that a rank left over from an earlier start cannot join a later one.
pub fn derive_token(token: &str, label: &str) -> String {
    hmac_sha256(token.as_bytes(), &[b"kiln-derive ", label.as_bytes()])
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `a` equals `b`, in time independent of where they differ.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// 16 fresh random bytes from the kernel.
fn nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| format!("cannot read /dev/urandom for a nonce: {e}"))?;
    Ok(n)
}

fn accept_proof(token: &[u8], nonce_c: &[u8], nonce_a: &[u8]) -> [u8; MAC] {
    hmac_sha256(token, &[b"kiln-auth accept", nonce_c, nonce_a])
}

fn connect_proof(token: &[u8], nonce_a: &[u8], nonce_c: &[u8], bound: &[u8]) -> [u8; MAC] {
    hmac_sha256(token, &[b"kiln-auth connect", nonce_a, nonce_c, bound])
}

/// The connecting side: proves `token` (when there is one) to the acceptor at the other end,
/// checks the acceptor's proof, and sends `bound` after the proof.
///
/// # Errors
/// The connection fails, or the acceptor does not know the token (text saying so).
pub(crate) fn connect(
    r: &mut impl Read,
    w: &mut impl Write,
    token: Option<&str>,
    bound: &[u8],
) -> Result<(), String> {
    let nonce_c = nonce()?;
    let mut hello = Vec::with_capacity(4 + 1 + NONCE);
    hello.extend_from_slice(&MAGIC);
    hello.push(u8::from(token.is_some()));
    hello.extend_from_slice(&nonce_c);
    w.write_all(&hello)
        .and_then(|()| w.flush())
        .map_err(|e| format!("sending the handshake: {e}"))?;
    let mut answer = [0u8; NONCE + 1 + MAC];
    r.read_exact(&mut answer)
        .map_err(|e| format!("no handshake answer: {e}"))?;
    let (nonce_a, rest) = answer.split_at(NONCE);
    let (has, theirs) = rest.split_at(1);
    let proven = match token {
        Some(t) if has[0] == 1 => {
            same_secret(theirs, &accept_proof(t.as_bytes(), &nonce_c, nonce_a))
        }
        _ => true,
    };
    // The proof goes out either way (it reveals nothing of the token), so that the acceptor
    // can say why it refuses, in its log and to this side.
    let proof = connect_proof(token.unwrap_or("").as_bytes(), nonce_a, &nonce_c, bound);
    let mut out = Vec::with_capacity(MAC + bound.len());
    out.extend_from_slice(&proof);
    out.extend_from_slice(bound);
    w.write_all(&out)
        .and_then(|()| w.flush())
        .map_err(|e| format!("sending the proof: {e}"))?;
    if proven {
        Ok(())
    } else {
        Err(
            "it could not prove this job's token: another job's (KILN_JOB_TOKEN differs), or \
             not a kiln process of this job"
                .into(),
        )
    }
}

/// The accepting side: asks the connector to prove `token` (`None`: any connector is taken),
/// proving it in turn; returns the `bound_len` bytes the connector bound to its proof.
///
/// # Errors
/// Why the connection is refused: not kiln, an older kiln, no token, a wrong proof (another
/// job's token, or replayed bytes).
pub(crate) fn accept(
    r: &mut impl Read,
    w: &mut impl Write,
    token: Option<&str>,
    bound_len: usize,
) -> Result<Vec<u8>, String> {
    let mut first = [0u8; 4 + 1 + NONCE];
    r.read_exact(&mut first[..4])
        .map_err(|e| format!("no handshake ({e})"))?;
    if first[..4] == OLD_MAGIC {
        return Err(
            "it speaks an older kiln's handshake (it sends the job token instead of proving \
             it): run the same kiln on every node"
                .into(),
        );
    }
    if first[..4] != MAGIC {
        return Err("not a kiln process (no handshake)".into());
    }
    r.read_exact(&mut first[4..])
        .map_err(|e| format!("no handshake ({e})"))?;
    let has_token = first[4] == 1;
    let nonce_c = &first[5..];
    let nonce_a = nonce()?;
    let proof = match token {
        Some(t) => accept_proof(t.as_bytes(), nonce_c, &nonce_a),
        None => [0; MAC],
    };
    let mut answer = Vec::with_capacity(NONCE + 1 + MAC);
    answer.extend_from_slice(&nonce_a);
    answer.push(u8::from(token.is_some()));
    answer.extend_from_slice(&proof);
    w.write_all(&answer)
        .and_then(|()| w.flush())
        .map_err(|e| format!("answering the handshake: {e}"))?;
    let mut rest = vec![0u8; MAC + bound_len];
    r.read_exact(&mut rest)
        .map_err(|e| format!("no proof of the job token ({e})"))?;
    let (proof, bound) = rest.split_at(MAC);
    if let Some(t) = token {
        if !has_token {
            return Err("it presented no job token (KILN_JOB_TOKEN unset?)".into());
        }
        if !same_secret(
            proof,
            &connect_proof(t.as_bytes(), &nonce_a, nonce_c, bound),
        ) {
            return Err(
                "it presented another job's token (KILN_JOB_TOKEN differs), or replayed \
                 another connection's handshake: its proof does not answer this connection's \
                 challenge"
                    .into(),
            );
        }
    }
    Ok(bound.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        // Test case 2 of RFC 4231.
        let mac = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_ne!(derive_token("t", "round 1"), derive_token("t", "round 2"));
        assert_eq!(derive_token("t", "round 1").len(), 64);
    }
}
