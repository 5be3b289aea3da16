//! The one place where a script's arguments and its reply are laid out: each script declares
//! its arguments and its reply as a list of named [`Field`]s; from that list this module writes
//! the Lua that reads the arguments into a table (`args.id`, `args.held`, ...) and the Lua
//! function that lays a reply out (`reply{capacity = cap, ...}`), and the Rust side encodes and
//! decodes through the same list ([`Encoder`], [`Decoder`]), naming each field as it goes. A
//! script body and its Rust caller name fields; no one else counts positions.

use redis::ScriptInvocation;

use crate::error::Error;

/// One field of a script's arguments or reply, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Field {
    /// A string.
    Text(&'static str),
    /// A number (Lua reads it with `tonumber`); in a reply, an absent one is empty.
    Number(&'static str),
    /// A list of strings: its length, then each.
    Texts(&'static str),
    /// A list of numbers: its length, then each.
    Numbers(&'static str),
    /// A list of records of the fields given (none of them a list): its length, then each
    /// record's fields in order.
    Records(&'static str, &'static [Field]),
    /// A reply's last field only: every value left, as `name`, `value` pairs (a hash as
    /// `HGETALL` lists it).
    Pairs(&'static str),
}

impl Field {
    fn name(self) -> &'static str {
        match self {
            Field::Text(name)
            | Field::Number(name)
            | Field::Texts(name)
            | Field::Numbers(name)
            | Field::Records(name, _)
            | Field::Pairs(name) => name,
        }
    }
}

/// The arguments every script starts with, from `ARGV[1]`: the channel, the lease time to live
/// (ms), the capacity to set if the fleet has none, the claim timeout (ms), and the command to
/// publish with (`PUBLISH`, or `SPUBLISH` on a cluster).
pub(super) const COMMON: &[Field] = &[
    Field::Text("channel"),
    Field::Number("ttl"),
    Field::Text("default_cap"),
    Field::Number("claim_ms"),
    Field::Text("publish"),
];

/// The Lua that reads the arguments `layout` describes into the table `args`, after the
/// [`COMMON`] ones (which go to `args` too).
pub(super) fn lua_arguments(layout: &[Field]) -> String {
    let mut lua = String::from("local args, at = {}, 1\n");
    for field in COMMON.iter().chain(layout) {
        lua += &match *field {
            Field::Text(name) => format!("args.{name} = ARGV[at]; at = at + 1\n"),
            Field::Number(name) => format!("args.{name} = tonumber(ARGV[at]); at = at + 1\n"),
            Field::Texts(name) | Field::Numbers(name) => {
                let read = match field {
                    Field::Texts(_) => "ARGV[at]",
                    _ => "tonumber(ARGV[at])",
                };
                format!(
                    "args.{name} = {{}}\nfor i = 1, tonumber(ARGV[at]) do at = at + 1; \
                     args.{name}[i] = {read} end\nat = at + 1\n"
                )
            }
            Field::Records(name, fields) => {
                let mut read = String::new();
                for (offset, inner) in fields.iter().enumerate() {
                    read += &match inner {
                        Field::Text(inner) => format!("r.{inner} = ARGV[at + {offset}]; "),
                        Field::Number(inner) => {
                            format!("r.{inner} = tonumber(ARGV[at + {offset}]); ")
                        }
                        _ => unreachable!("a record's fields are text or numbers"),
                    };
                }
                format!(
                    "args.{name} = {{}}\nlocal count_{name} = tonumber(ARGV[at]); at = at + 1\n\
                     for i = 1, count_{name} do local r = {{}}; {read}args.{name}[i] = r; \
                     at = at + {} end\n",
                    fields.len()
                )
            }
            Field::Pairs(_) => unreachable!("pairs are a reply's"),
        };
    }
    lua
}

/// The Lua function `reply(r)` that lays out the reply `layout` describes from the table `r`:
/// every value as a string (an absent number as an empty one), lists with their length first.
pub(super) fn lua_reply(layout: &[Field]) -> String {
    let mut lua = String::from(
        "local function reply(r)\n  local out = {}\n  \
         local function put(value) if value == nil or value == false then \
         out[#out + 1] = '' else out[#out + 1] = tostring(value) end end\n",
    );
    for field in layout {
        lua += &match *field {
            Field::Text(name) | Field::Number(name) => format!("  put(r.{name})\n"),
            Field::Texts(name) | Field::Numbers(name) => {
                format!("  put(#r.{name})\n  for _, value in ipairs(r.{name}) do put(value) end\n")
            }
            Field::Pairs(name) => {
                format!("  for _, value in ipairs(r.{name} or {{}}) do put(value) end\n")
            }
            Field::Records(..) => unreachable!("records are arguments"),
        };
    }
    lua + "  return out\nend\n"
}

/// Puts a script's own arguments on its invocation, in its layout's order, by name.
pub(super) struct Encoder<'i, 'a> {
    invocation: &'i mut ScriptInvocation<'a>,
    layout: &'static [Field],
    at: usize,
}

impl<'i, 'a> Encoder<'i, 'a> {
    pub(super) fn new(invocation: &'i mut ScriptInvocation<'a>, layout: &'static [Field]) -> Self {
        Self {
            invocation,
            layout,
            at: 0,
        }
    }

    /// The next field, which must be `expected`.
    fn next(&mut self, expected: Field) {
        let field = self.layout.get(self.at).copied();
        assert_eq!(
            field.map(Field::name),
            Some(expected.name()),
            "encoded out of its layout"
        );
        self.at += 1;
    }

    pub(super) fn text(&mut self, name: &'static str, value: &str) -> &mut Self {
        self.next(Field::Text(name));
        self.invocation.arg(value);
        self
    }

    pub(super) fn number(&mut self, name: &'static str, value: impl Into<f64> + Copy) -> &mut Self {
        self.next(Field::Number(name));
        let value: f64 = value.into();
        // Integers as integers: Lua's `tonumber` reads both, and a reader of the arguments
        // (`MONITOR`) sees what was meant.
        if value.fract() == 0.0 && value.abs() < 9e15 {
            self.invocation.arg(value as i64);
        } else {
            self.invocation.arg(value);
        }
        self
    }

    pub(super) fn texts(&mut self, name: &'static str, values: &[String]) -> &mut Self {
        self.next(Field::Texts(name));
        self.invocation.arg(values.len()).arg(values);
        self
    }

    pub(super) fn records<T>(
        &mut self,
        name: &'static str,
        records: &[T],
        mut each: impl FnMut(&T, &mut Record<'_, 'i, 'a>),
    ) -> &mut Self {
        let Some(Field::Records(_, fields)) = self.layout.get(self.at).copied() else {
            panic!("encoded out of its layout: {name} is not a list of records here");
        };
        self.next(Field::Records(name, fields));
        self.invocation.arg(records.len());
        for record in records {
            let mut writer = Record {
                encoder: self,
                fields,
                at: 0,
            };
            each(record, &mut writer);
            assert_eq!(writer.at, fields.len(), "a record of {name} not whole");
        }
        self
    }

    /// Every field was encoded.
    pub(super) fn finish(&self) {
        assert_eq!(self.at, self.layout.len(), "arguments not whole");
    }
}

/// One record of a list of records, written field by field.
pub(super) struct Record<'e, 'i, 'a> {
    encoder: &'e mut Encoder<'i, 'a>,
    fields: &'static [Field],
    at: usize,
}

impl Record<'_, '_, '_> {
    fn next(&mut self, expected: &'static str) {
        assert_eq!(
            self.fields.get(self.at).map(|field| field.name()),
            Some(expected),
            "a record encoded out of its layout"
        );
        self.at += 1;
    }

    pub(super) fn text(&mut self, name: &'static str, value: &str) -> &mut Self {
        self.next(name);
        self.encoder.invocation.arg(value);
        self
    }

    pub(super) fn number(&mut self, name: &'static str, value: i64) -> &mut Self {
        self.next(name);
        self.encoder.invocation.arg(value);
        self
    }
}

/// Reads a script's reply, in its layout's order, by name.
pub(super) struct Decoder<'r> {
    values: &'r [String],
    layout: &'static [Field],
    at: usize,
    read: usize,
}

/// A reply that is not what its layout says: the script and its caller disagree.
#[derive(Debug)]
pub(super) struct Malformed(pub(super) String);

impl<'r> Decoder<'r> {
    pub(super) fn new(values: &'r [String], layout: &'static [Field]) -> Self {
        Self {
            values,
            layout,
            at: 0,
            read: 0,
        }
    }

    fn next(&mut self, expected: Field) -> Result<(), Malformed> {
        match self.layout.get(self.at).copied() {
            Some(field) if field.name() == expected.name() => {
                self.at += 1;
                Ok(())
            }
            field => Err(Malformed(format!(
                "read {} where the layout has {field:?}",
                expected.name()
            ))),
        }
    }

    fn value(&mut self, name: &str) -> Result<&'r str, Malformed> {
        let value = self
            .values
            .get(self.read)
            .ok_or_else(|| Malformed(format!("the reply ends before {name}")))?;
        self.read += 1;
        Ok(value)
    }

    pub(super) fn text(&mut self, name: &'static str) -> Result<String, Malformed> {
        self.next(Field::Text(name))?;
        self.value(name).map(str::to_owned)
    }

    /// A number, `None` if absent (empty).
    pub(super) fn number(&mut self, name: &'static str) -> Result<Option<i64>, Malformed> {
        self.next(Field::Number(name))?;
        let value = self.value(name)?;
        if value.is_empty() {
            return Ok(None);
        }
        value
            .parse::<f64>()
            .map(|number| Some(number as i64))
            .map_err(|_| Malformed(format!("{name} is not a number: {value:?}")))
    }

    /// A count: a number that is there, and not negative.
    pub(super) fn count(&mut self, name: &'static str) -> Result<usize, Malformed> {
        self.number(name)?
            .and_then(|value| usize::try_from(value).ok())
            .ok_or_else(|| Malformed(format!("{name} is not a count")))
    }

    pub(super) fn numbers(&mut self, name: &'static str) -> Result<Vec<i64>, Malformed> {
        self.next(Field::Numbers(name))?;
        let length: usize = self
            .value(name)?
            .parse()
            .map_err(|_| Malformed(format!("{name}'s length is not a count")))?;
        (0..length)
            .map(|_| {
                let value = self.value(name)?;
                value
                    .parse::<f64>()
                    .map(|number| number as i64)
                    .map_err(|_| Malformed(format!("{name} holds {value:?}")))
            })
            .collect()
    }

    /// The rest of the reply, as pairs.
    pub(super) fn pairs(&mut self, name: &'static str) -> Result<Vec<(String, String)>, Malformed> {
        self.next(Field::Pairs(name))?;
        let rest = &self.values[self.read..];
        self.read = self.values.len();
        Ok(rest
            .chunks_exact(2)
            .map(|pair| (pair[0].clone(), pair[1].clone()))
            .collect())
    }

    /// Every field was read, and nothing is left over.
    pub(super) fn finish(&self) -> Result<(), Malformed> {
        if self.at != self.layout.len() || self.read != self.values.len() {
            return Err(Malformed(format!(
                "read {} of {} fields and {} of {} values",
                self.at,
                self.layout.len(),
                self.read,
                self.values.len()
            )));
        }
        Ok(())
    }
}

impl Malformed {
    /// As the limit's error.
    pub(super) fn into_error(
        self,
        limit: &std::sync::Arc<str>,
        address: &str,
        script: &str,
    ) -> Error {
        Error::unexpected(limit, address, &format!("{script}: {}", self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: &[Field] = &[
        Field::Text("id"),
        Field::Number("bound"),
        Field::Texts("ids"),
        Field::Records("series", &[Field::Text("prefix"), Field::Number("e")]),
    ];

    #[test]
    fn the_lua_reads_each_field_by_name_after_the_common_ones() {
        let lua = lua_arguments(LAYOUT);
        for name in [
            "channel",
            "ttl",
            "default_cap",
            "claim_ms",
            "publish",
            "id",
            "bound",
        ] {
            assert!(lua.contains(&format!("args.{name} =")), "{name}: {lua}");
        }
        assert!(lua.contains("args.ids[i] = ARGV[at]"), "{lua}");
        assert!(lua.contains("r.prefix = ARGV[at + 0]; r.e = tonumber(ARGV[at + 1])"));
    }

    #[test]
    fn a_reply_is_read_by_name_and_must_be_whole() {
        const REPLY: &[Field] = &[
            Field::Number("capacity"),
            Field::Number("missing"),
            Field::Numbers("statuses"),
            Field::Pairs("window"),
        ];
        let values: Vec<String> = ["7", "", "2", "1", "3", "ended", "4"]
            .iter()
            .map(|value| (*value).to_owned())
            .collect();
        let mut reply = Decoder::new(&values, REPLY);
        assert_eq!(reply.count("capacity").unwrap(), 7);
        assert_eq!(reply.number("missing").unwrap(), None);
        assert_eq!(reply.numbers("statuses").unwrap(), vec![1, 3]);
        assert_eq!(
            reply.pairs("window").unwrap(),
            vec![("ended".to_owned(), "4".to_owned())]
        );
        reply.finish().unwrap();

        let mut out_of_order = Decoder::new(&values, REPLY);
        assert!(out_of_order.count("missing").is_err());
        let short = Decoder::new(&values[..1], REPLY);
        assert!(short.finish().is_err());
    }
}
