//! What the services' own descriptors say about their methods: the services, their
//! methods, each method's `idempotency_level` option and streaming kind.
//!
//! The proto already says which methods are safe to repeat:
//!
//! ```proto
//! rpc GetCharge(GetChargeRequest) returns (Charge) {
//!   option idempotency_level = NO_SIDE_EFFECTS;
//! }
//! ```
//!
//! Every method without the option has side effects. Attached to a service config
//! ([`ServiceConfig::with_descriptors`](crate::config::ServiceConfig::with_descriptors)),
//! [`Descriptors`] make the proto the source of truth: every configured name must match
//! a real service or method, and side-effecting methods are protected unless the config
//! opts them out (see the [config docs](crate::config#from-your-proto)).
//!
//! Read them from the `FileDescriptorSet` bytes a build script already writes
//! (tonic-prost-build's `file_descriptor_set_path`, the bytes tonic-reflection serves),
//! or, with the `protox` feature, compile `.proto` files without `protoc`:
//!
//! ```
//! use idem_core::descriptor::{Descriptors, IdempotencyLevel, Streaming};
//! use prost::Message as _;
//! # let set = prost_types::FileDescriptorSet { file: vec![prost_types::FileDescriptorProto {
//! #     name: Some("p.proto".into()), package: Some("payments.v1".into()),
//! #     service: vec![prost_types::ServiceDescriptorProto { name: Some("Payments".into()),
//! #         method: vec![prost_types::MethodDescriptorProto { name: Some("Charge".into()),
//! #             ..Default::default() }], ..Default::default() }], ..Default::default() }] };
//! # let bytes = set.encode_to_vec();
//! let descriptors = Descriptors::from_file_descriptor_set(&bytes).unwrap();
//! let charge = descriptors.method("payments.v1.Payments", "Charge").unwrap();
//! assert_eq!(charge.idempotency_level(), IdempotencyLevel::IdempotencyUnknown);
//! assert_eq!(charge.streaming(), Streaming::Unary);
//! ```

use std::collections::HashMap;
use std::fmt;

use prost::Message as _;
use prost_types::{FileDescriptorSet, MethodDescriptorProto};

mod nearest;
#[cfg(feature = "protox")]
mod protox;

pub use nearest::{edit_distance, nearest};

/// A method's `idempotency_level` option (`google.protobuf.MethodOptions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdempotencyLevel {
    /// The option is unset (or `IDEMPOTENCY_UNKNOWN`): the method has side effects.
    IdempotencyUnknown,
    /// `NO_SIDE_EFFECTS`: a read; may be retried and hedged without a key.
    NoSideEffects,
    /// `IDEMPOTENT`: repeating it changes nothing more; may be retried without a key.
    Idempotent,
}

impl IdempotencyLevel {
    /// The proto enum name: `IDEMPOTENCY_UNKNOWN`, `NO_SIDE_EFFECTS` or `IDEMPOTENT`.
    pub const fn name(self) -> &'static str {
        match self {
            IdempotencyLevel::IdempotencyUnknown => "IDEMPOTENCY_UNKNOWN",
            IdempotencyLevel::NoSideEffects => "NO_SIDE_EFFECTS",
            IdempotencyLevel::Idempotent => "IDEMPOTENT",
        }
    }

    /// Whether running the method twice can do harm (the level is unset).
    pub const fn has_side_effects(self) -> bool {
        matches!(self, IdempotencyLevel::IdempotencyUnknown)
    }

    /// The level of the option's integer value; an unknown value is read as unset
    /// (side effects), the safe side.
    fn from_i32(v: Option<i32>) -> Self {
        match v {
            Some(1) => IdempotencyLevel::NoSideEffects,
            Some(2) => IdempotencyLevel::Idempotent,
            _ => IdempotencyLevel::IdempotencyUnknown,
        }
    }
}

impl fmt::Display for IdempotencyLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which sides of a method stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Streaming {
    /// One request, one response.
    Unary,
    /// A stream of requests, one response.
    Client,
    /// One request, a stream of responses.
    Server,
    /// Both sides stream: never protected (its requests are not one message the
    /// server could fingerprint before the handler runs).
    Bidi,
}

impl Streaming {
    /// `unary`, `client`, `server` or `bidi`.
    pub const fn name(self) -> &'static str {
        match self {
            Streaming::Unary => "unary",
            Streaming::Client => "client",
            Streaming::Server => "server",
            Streaming::Bidi => "bidi",
        }
    }
}

impl fmt::Display for Streaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One method of a service, as its descriptor says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodDescriptor {
    service: String,
    name: String,
    level: IdempotencyLevel,
    streaming: Streaming,
}

impl MethodDescriptor {
    /// A method described in code (for tests and services without a descriptor set).
    pub fn new(
        service: impl Into<String>,
        name: impl Into<String>,
        level: IdempotencyLevel,
        streaming: Streaming,
    ) -> Self {
        MethodDescriptor {
            service: service.into(),
            name: name.into(),
            level,
            streaming,
        }
    }
    /// The fully-qualified service name (`payments.v1.Payments`).
    pub fn service(&self) -> &str {
        &self.service
    }
    /// The method name (`Charge`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// `payments.v1.Payments/Charge`, as in service-config names and request paths.
    pub fn full_name(&self) -> String {
        format!("{}/{}", self.service, self.name)
    }
    /// The `idempotency_level` option.
    pub fn idempotency_level(&self) -> IdempotencyLevel {
        self.level
    }
    /// Which sides stream.
    pub fn streaming(&self) -> Streaming {
        self.streaming
    }
}

/// The services and methods of one or more proto files.
///
/// Cheap to share behind an `Arc`; lookups are by name, at build time only (the layers
/// turn what the descriptors say into config entries once).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptors {
    /// Service name → its methods, in file order.
    services: Vec<(String, Vec<MethodDescriptor>)>,
    by_service: HashMap<String, usize>,
}

/// Why descriptors could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// The bytes are not an encoded `google.protobuf.FileDescriptorSet`.
    #[error("not a FileDescriptorSet: {0}")]
    NotAFileDescriptorSet(String),
    /// A `.proto` file does not compile (protox's `file:line:column: message`), or an
    /// import is missing.
    #[error("{0}")]
    Compile(String),
    /// Two files describe the same service.
    #[error("service {0} is described twice")]
    DuplicateService(String),
}

impl Descriptors {
    /// The services of an encoded `FileDescriptorSet` (what tonic-prost-build writes with
    /// `file_descriptor_set_path`, and `protoc --descriptor_set_out`).
    ///
    /// # Errors
    /// [`DescriptorError::NotAFileDescriptorSet`] when the bytes do not decode as one,
    /// hold no file, or hold a file or method without a name;
    /// [`DescriptorError::DuplicateService`] when two files describe one service.
    pub fn from_file_descriptor_set(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let set = FileDescriptorSet::decode(bytes)
            .map_err(|e| DescriptorError::NotAFileDescriptorSet(e.to_string()))?;
        Self::from_set(&set)
    }

    /// The services of a decoded `FileDescriptorSet`.
    ///
    /// # Errors
    /// As [`from_file_descriptor_set`](Self::from_file_descriptor_set).
    pub fn from_set(set: &FileDescriptorSet) -> Result<Self, DescriptorError> {
        let bad = |why: &str| DescriptorError::NotAFileDescriptorSet(why.to_owned());
        if set.file.is_empty() {
            return Err(bad("it holds no file"));
        }
        let mut d = Descriptors::default();
        for file in &set.file {
            if file.name.as_deref().is_none_or(str::is_empty) {
                return Err(bad("a file has no name"));
            }
            for service in &file.service {
                let Some(name) = service.name.as_deref().filter(|n| !n.is_empty()) else {
                    return Err(bad("a service has no name"));
                };
                let full = match file.package.as_deref() {
                    Some(p) if !p.is_empty() => format!("{p}.{name}"),
                    _ => name.to_owned(),
                };
                let methods = service
                    .method
                    .iter()
                    .map(|m| method(&full, m).ok_or_else(|| bad("a method has no name")))
                    .collect::<Result<Vec<_>, _>>()?;
                d.add_service(full, methods)?;
            }
        }
        Ok(d)
    }

    /// Descriptors built in code: one service and its methods.
    ///
    /// # Errors
    /// [`DescriptorError::DuplicateService`] when the service is already there.
    pub fn with_service(
        mut self,
        name: impl Into<String>,
        methods: impl IntoIterator<Item = (String, IdempotencyLevel, Streaming)>,
    ) -> Result<Self, DescriptorError> {
        let name = name.into();
        let methods = methods
            .into_iter()
            .map(|(m, level, streaming)| MethodDescriptor::new(name.clone(), m, level, streaming))
            .collect();
        self.add_service(name, methods)?;
        Ok(self)
    }

    fn add_service(
        &mut self,
        name: String,
        methods: Vec<MethodDescriptor>,
    ) -> Result<(), DescriptorError> {
        if self.by_service.contains_key(&name) {
            return Err(DescriptorError::DuplicateService(name));
        }
        self.by_service.insert(name.clone(), self.services.len());
        self.services.push((name, methods));
        Ok(())
    }

    /// The service names, in file order.
    pub fn services(&self) -> impl Iterator<Item = &str> {
        self.services.iter().map(|(n, _)| n.as_str())
    }

    /// The methods of `service`, or `None` when there is no such service.
    pub fn service(&self, service: &str) -> Option<&[MethodDescriptor]> {
        let i = *self.by_service.get(service)?;
        Some(&self.services[i].1)
    }

    /// `service/method`'s descriptor.
    pub fn method(&self, service: &str, method: &str) -> Option<&MethodDescriptor> {
        self.service(service)?.iter().find(|m| m.name == method)
    }

    /// The descriptor of the method at an HTTP/2 path (`/payments.v1.Payments/Charge`).
    pub fn method_by_path(&self, path: &str) -> Option<&MethodDescriptor> {
        let (service, method) = crate::config::split_path(path)?;
        self.method(service, method)
    }

    /// Every method of every service, in file order.
    pub fn methods(&self) -> impl Iterator<Item = &MethodDescriptor> {
        self.services.iter().flat_map(|(_, m)| m.iter())
    }

    /// Whether no service is described.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }
}

fn method(service: &str, m: &MethodDescriptorProto) -> Option<MethodDescriptor> {
    let name = m.name.as_deref().filter(|n| !n.is_empty())?;
    let level = IdempotencyLevel::from_i32(m.options.as_ref().and_then(|o| o.idempotency_level));
    let streaming = match (m.client_streaming(), m.server_streaming()) {
        (false, false) => Streaming::Unary,
        (true, false) => Streaming::Client,
        (false, true) => Streaming::Server,
        (true, true) => Streaming::Bidi,
    };
    Some(MethodDescriptor::new(service, name, level, streaming))
}

#[cfg(test)]
mod tests;
