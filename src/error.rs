//! [`ConfigError`]: a value the crate cannot take (a capacity, a limit's name, an attribute
//! from a config file). It stands below the attributes, whose values it names, so that they can
//! be parsed from configuration.

use std::error::Error;
use std::fmt;

/// A value the crate cannot take: a limit's capacity (0, or above tokio's
/// `Semaphore::MAX_PERMITS`), a limit's name that cannot be a metric attribute, or an
/// attribute value that is not one of NeMo Gym's. Its message names the value (at most 64 bytes
/// of it) and what is allowed.
///
/// ```
/// use tower_resources_operation::{ConfigError, Limit, Operation};
///
/// let unknown: ConfigError = "grade".parse::<Operation>().unwrap_err();
/// assert_eq!(unknown.setting(), "operation");
/// assert_eq!(unknown.to_string(), r#"unknown operation "grade"; expected one of: verify, tool, judge, other"#);
///
/// let empty = Limit::try_new(0).unwrap_err();
/// assert_eq!(empty.setting(), "capacity");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    kind: ConfigKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum ConfigKind {
    /// A capacity a limit cannot have.
    Capacity(usize),
    /// A name that cannot be a metric attribute (cut to 64 bytes).
    Name(String),
    /// An attribute value that is not one of `valid` (cut to 64 bytes).
    Attribute {
        attribute: &'static str,
        valid: &'static [&'static str],
        input: String,
    },
}

/// The most of a refused value that a message repeats.
const MAX_ECHOED: usize = 64;

/// `input`, cut to at most [`MAX_ECHOED`] bytes on a character boundary.
fn echoed(input: &str) -> String {
    let mut end = input.len().min(MAX_ECHOED);
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    input[..end].to_owned()
}

impl ConfigError {
    pub(crate) fn capacity(capacity: usize) -> Self {
        Self {
            kind: ConfigKind::Capacity(capacity),
        }
    }

    pub(crate) fn name(name: &str) -> Self {
        Self {
            kind: ConfigKind::Name(echoed(name)),
        }
    }

    pub(crate) fn attribute(
        attribute: &'static str,
        valid: &'static [&'static str],
        input: &str,
    ) -> Self {
        Self {
            kind: ConfigKind::Attribute {
                attribute,
                valid,
                input: echoed(input),
            },
        }
    }

    /// What was refused: `"capacity"`, `"name"` (a limit's), or the attribute (`"operation"`,
    /// `"executor"`, `"outcome"`, `"rejection"`).
    pub fn setting(&self) -> &'static str {
        match &self.kind {
            ConfigKind::Capacity(_) => "capacity",
            ConfigKind::Name(_) => "name",
            ConfigKind::Attribute { attribute, .. } => attribute,
        }
    }

    /// The values the setting may take, where there is a list of them (an attribute's); empty
    /// otherwise.
    pub fn valid_values(&self) -> &'static [&'static str] {
        match &self.kind {
            ConfigKind::Attribute { valid, .. } => valid,
            _ => &[],
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ConfigKind::Capacity(0) => f.write_str(
                "tower-resources-operation: a limit of 0 operations would admit nothing, ever; \
                 give it 1 or more (set_capacity(0) pauses a limit that serves)",
            ),
            ConfigKind::Capacity(capacity) => write!(
                f,
                "tower-resources-operation: a limit of {capacity} operations is above tokio's \
                 Semaphore::MAX_PERMITS ({})",
                tokio::sync::Semaphore::MAX_PERMITS
            ),
            ConfigKind::Name(name) => write!(
                f,
                "tower-resources-operation: a limit's name becomes a metric attribute, so it \
                 must be 1 to 64 characters among A-Z a-z 0-9 _ . : / -, starting with a \
                 letter; got {name:?}"
            ),
            ConfigKind::Attribute {
                attribute,
                valid,
                input,
            } => write!(
                f,
                "unknown {attribute} {input:?}; expected one of: {}",
                valid.join(", ")
            ),
        }
    }
}

impl Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_value_is_echoed_cut_on_a_char_boundary() {
        let long = "é".repeat(100);
        let error = ConfigError::attribute("executor", &["inline"], &long);
        let ConfigKind::Attribute { input, .. } = &error.kind else {
            panic!("an attribute's error")
        };
        assert!(input.len() <= MAX_ECHOED);
        assert!(error.to_string().ends_with("expected one of: inline"));
        assert_eq!(
            ConfigError::name(&long).to_string().matches('é').count(),
            32
        );
    }
}
