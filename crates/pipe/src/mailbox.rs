//! Tensors between stages: each message is a header (what it is, its shape) and its values.
//!
//! A stage reads messages from a neighbour in the order they were sent, keeping any that it
//! does not want yet: the schedule decides the order in which a stage *needs* messages, and
//! the sender's order may differ (interleaved schedules send activations and gradients down the
//! same link). Sends never wait for the receiver, so a schedule whose passes' inputs all exist
//! (which [`Schedule::simulate`](crate::Schedule::simulate) checks) cannot deadlock.

use crate::PipeError;
use kiln_comm::{BufMut, BufRef, ProcessGroup};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Tag {
    /// The input of `chunk` for micro-batch `mb` (the previous chunk's output).
    Activation { mb: usize, chunk: usize },
    /// The gradient of `chunk`'s output for micro-batch `mb`.
    Gradient { mb: usize, chunk: usize },
    /// The gradient of shared parameter `index`, accumulated over the step.
    SharedGrad { index: usize },
    /// The value of shared parameter `index` after the optimizer step (the range this rank
    /// holds).
    SharedValue { index: usize },
}

impl Tag {
    fn encode(self) -> [i64; 3] {
        let n = |x: usize| x as i64;
        match self {
            Tag::Activation { mb, chunk } => [0, n(mb), n(chunk)],
            Tag::Gradient { mb, chunk } => [1, n(mb), n(chunk)],
            Tag::SharedGrad { index } => [2, n(index), 0],
            Tag::SharedValue { index } => [3, n(index), 0],
        }
    }

    fn decode(v: [i64; 3]) -> Option<Tag> {
        let (a, b) = (usize::try_from(v[1]).ok()?, usize::try_from(v[2]).ok()?);
        Some(match v[0] {
            0 => Tag::Activation { mb: a, chunk: b },
            1 => Tag::Gradient { mb: a, chunk: b },
            2 => Tag::SharedGrad { index: a },
            3 => Tag::SharedValue { index: a },
            _ => return None,
        })
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tag::Activation { mb, chunk } => {
                write!(f, "the activation of micro-batch {mb} into chunk {chunk}")
            }
            Tag::Gradient { mb, chunk } => {
                write!(f, "the gradient of micro-batch {mb} out of chunk {chunk}")
            }
            Tag::SharedGrad { index } => write!(f, "the gradient of shared parameter {index}"),
            Tag::SharedValue { index } => write!(f, "the value of shared parameter {index}"),
        }
    }
}

/// Header: the tag (3), the rank and dims (at most 4) of the values.
const HEADER: usize = 8;

/// A tensor received: its dims and values.
pub(crate) type Received = (Vec<usize>, Vec<f32>);

/// One stage's messages with its neighbours over a step.
pub(crate) struct Mailbox<'a> {
    group: &'a dyn ProcessGroup,
    held: HashMap<(usize, Tag), Received>,
    /// Time spent in `take` waiting for messages.
    pub waited: Duration,
    /// Bytes sent.
    pub sent: usize,
}

impl<'a> Mailbox<'a> {
    pub fn new(group: &'a dyn ProcessGroup) -> Self {
        Mailbox {
            group,
            held: HashMap::new(),
            waited: Duration::ZERO,
            sent: 0,
        }
    }

    /// Sends `values` of shape `dims` to stage `dst` as `tag`.
    pub fn send(
        &mut self,
        tag: Tag,
        dst: usize,
        dims: &[usize],
        values: &[f32],
    ) -> Result<(), PipeError> {
        assert!(
            dims.len() <= HEADER - 4,
            "kiln pipeline: a tensor of rank {}",
            dims.len()
        );
        debug_assert_eq!(dims.iter().product::<usize>(), values.len());
        let mut header = [0i64; HEADER];
        header[..3].copy_from_slice(&tag.encode());
        header[3] = dims.len() as i64;
        for (h, d) in header[4..].iter_mut().zip(dims) {
            *h = *d as i64;
        }
        let stage = self.group.rank();
        let err = |source| PipeError::Comm {
            stage,
            what: format!("sending {tag} to stage {dst}"),
            source: Box::new(source),
        };
        self.group.send(BufRef::I64(&header), dst).map_err(err)?;
        self.group.send(BufRef::F32(values), dst).map_err(err)?;
        self.sent += values.len() * 4 + HEADER * 8;
        Ok(())
    }

    /// The message `tag` from stage `src`, reading (and keeping) the messages sent before it.
    pub fn take(&mut self, tag: Tag, src: usize) -> Result<Received, PipeError> {
        let start = Instant::now();
        let out = loop {
            if let Some(m) = self.held.remove(&(src, tag)) {
                break Ok(m);
            }
            match self.receive(src) {
                Ok((got, m)) => {
                    self.held.insert((src, got), m);
                }
                Err(ReceiveError::Comm(source)) => {
                    break Err(PipeError::Comm {
                        stage: self.group.rank(),
                        what: format!("waiting for {tag} from stage {src}"),
                        source: Box::new(source),
                    });
                }
                Err(ReceiveError::Header(header)) => {
                    break Err(PipeError::Protocol(format!(
                        "stage {}: a malformed message header from stage {src}: {header:?}",
                        self.group.rank()
                    )));
                }
            }
        };
        self.waited += start.elapsed();
        out
    }

    fn receive(&mut self, src: usize) -> Result<(Tag, Received), ReceiveError> {
        let mut header = [0i64; HEADER];
        kiln_shard::account::waiting(|| self.group.recv(BufMut::I64(&mut header), src))
            .map_err(ReceiveError::Comm)?;
        let rank = header[3] as usize;
        let tag = Tag::decode([header[0], header[1], header[2]]).filter(|_| rank <= HEADER - 4);
        let Some(tag) = tag else {
            return Err(ReceiveError::Header(header));
        };
        let dims: Vec<usize> = header[4..4 + rank].iter().map(|&d| d as usize).collect();
        let mut values = vec![0f32; dims.iter().product()];
        kiln_shard::account::waiting(|| self.group.recv(BufMut::F32(&mut values), src))
            .map_err(ReceiveError::Comm)?;
        Ok((tag, (dims, values)))
    }
}

enum ReceiveError {
    Comm(kiln_comm::CommError),
    Header([i64; HEADER]),
}
