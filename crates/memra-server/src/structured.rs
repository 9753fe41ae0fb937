//! The request fields that shape the output: OpenAI's `response_format` (`text`,
//! `json_object`, `json_schema`), llama-server's `grammar` (GBNF, or llguidance's Lark) and
//! `json_schema`, and the tools (`tools`, `tool_choice`, `parallel_tool_calls`).

use memra_engine::constraint::Grammar;
use serde_json::Value;

use crate::error::ApiError;
use crate::params::Fields;
use crate::tools::Tool;

/// A grammar the output must match, and the field it came from (for errors).
#[derive(Clone, Debug, PartialEq)]
pub struct OutputGrammar {
    pub grammar: Grammar,
    pub field: &'static str,
}

fn type_error(name: &str, want: &str) -> ApiError {
    ApiError::invalid(name, format!("'{name}' must be {want}"))
}

/// The grammar of `response_format`, `grammar` or `json_schema` (at most one of them).
pub fn output_grammar(f: &Fields) -> Result<Option<OutputGrammar>, ApiError> {
    let mut found: Vec<OutputGrammar> = Vec::new();
    if let Some(g) = response_format(f)? {
        found.push(OutputGrammar {
            grammar: g,
            field: "response_format",
        });
    }
    if let Some(text) = f.string("grammar")? {
        // GBNF always defines rules with `::=`; anything else is taken as Lark (as
        // llama.cpp's llguidance build takes `%llguidance` grammars).
        let grammar = match text.contains("::=") {
            true => Grammar::Gbnf(text.to_string()),
            false => Grammar::Lark(text.to_string()),
        };
        found.push(OutputGrammar {
            grammar,
            field: "grammar",
        });
    }
    if let Some(schema) = f.get("json_schema") {
        if !schema.is_object() {
            return Err(type_error("json_schema", "an object (a JSON schema)"));
        }
        found.push(OutputGrammar {
            grammar: Grammar::JsonSchema(schema.clone()),
            field: "json_schema",
        });
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|g| g.field).collect();
        return Err(ApiError::invalid(
            found[1].field,
            format!("give one of 'response_format', 'grammar' and 'json_schema', not {names:?}"),
        ));
    }
    Ok(found.pop())
}

fn response_format(f: &Fields) -> Result<Option<Grammar>, ApiError> {
    let Some(rf) = f.get("response_format") else {
        return Ok(None);
    };
    let Value::Object(rf) = rf else {
        return Err(type_error("response_format", "an object"));
    };
    let schema_at = |v: Option<&Value>, field: &str| -> Result<Option<Value>, ApiError> {
        match v.filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(s @ Value::Object(_)) => Ok(Some(s.clone())),
            Some(_) => Err(type_error(field, "an object (a JSON schema)")),
        }
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        // llama-server also takes a schema here.
        Some("json_object") => Ok(Some(
            match schema_at(rf.get("schema"), "response_format.schema")? {
                Some(s) => Grammar::JsonSchema(s),
                None => Grammar::JsonObject,
            },
        )),
        Some("json_schema") => {
            let js = match rf.get("json_schema") {
                Some(Value::Object(js)) => js,
                _ => {
                    return Err(type_error(
                        "response_format.json_schema",
                        "an object with the 'schema'",
                    ))
                }
            };
            if let Some(strict) = js.get("strict").filter(|v| !v.is_null()) {
                // Accepted: the output always matches the schema, strict or not.
                strict
                    .as_bool()
                    .ok_or_else(|| type_error("response_format.json_schema.strict", "a boolean"))?;
            }
            Ok(Some(
                match schema_at(js.get("schema"), "response_format.json_schema.schema")? {
                    Some(s) => Grammar::JsonSchema(s),
                    // OpenAI's schema is optional: any JSON object then.
                    None => Grammar::JsonObject,
                },
            ))
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("unknown response_format type {other:?} (text, json_object or json_schema)"),
        )),
        None => Err(type_error("response_format.type", "a string")),
    }
}

/// What `tool_choice` asks.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function(String),
}

/// The tools of a chat request.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    /// As given, for the chat template.
    pub raw: Value,
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// `tools`, `tool_choice` and `parallel_tool_calls`; `None` without tools.
pub fn tools(f: &Fields) -> Result<Option<ToolRequest>, ApiError> {
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("unknown tool_choice {other:?} (auto, none, required, or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}})"),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")) {
            Some(Value::String(n)) if o.get("type").and_then(Value::as_str) == Some("function") => {
                ToolChoice::Function(n.clone())
            }
            _ => {
                return Err(type_error(
                    "tool_choice",
                    "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
        Some(_) => return Err(type_error("tool_choice", "a string or an object")),
    };
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let list = match f.get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(type_error("tools", "an array")),
    };
    if list.is_empty() {
        return match choice {
            ToolChoice::Required | ToolChoice::Function(_) => Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' asks for a tool call but 'tools' declares none",
            )),
            _ => Ok(None),
        };
    }
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = |field: &str| format!("tools[{i}].{field}");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                at("type"),
                "only tools of type \"function\" are supported",
            ));
        }
        let func = t
            .get("function")
            .filter(|v| v.is_object())
            .ok_or_else(|| type_error(&at("function"), "an object"))?;
        let name = func
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| type_error(&at("function.name"), "a non-empty string"))?;
        let parameters = match func.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(type_error(
                    &at("function.parameters"),
                    "an object (a JSON schema)",
                ))
            }
        };
        tools.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    if let ToolChoice::Function(n) = &choice {
        if !tools.iter().any(|t| &t.name == n) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("'tool_choice' names {n:?}, which 'tools' does not declare"),
            ));
        }
    }
    Ok(Some(ToolRequest {
        raw: Value::Array(list),
        tools,
        choice,
        parallel,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn grammar_of(body: Value) -> Result<Option<OutputGrammar>, ApiError> {
        output_grammar(&Fields::of(&body).unwrap())
    }

    fn tools_of(body: Value) -> Result<Option<ToolRequest>, ApiError> {
        tools(&Fields::of(&body).unwrap())
    }

    fn param(r: Result<impl std::fmt::Debug, ApiError>) -> String {
        r.expect_err("refused").param.unwrap_or_default()
    }

    #[test]
    fn output_grammars_come_from_each_field() {
        let s = json!({"type": "object"});
        let g = |b| grammar_of(b).unwrap().map(|g| (g.grammar, g.field));
        assert_eq!(g(json!({"response_format": {"type": "text"}})), None);
        assert_eq!(
            g(json!({"response_format": {"type": "json_object"}})),
            Some((Grammar::JsonObject, "response_format"))
        );
        assert_eq!(
            g(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": true}}})
            ),
            Some((Grammar::JsonSchema(s.clone()), "response_format"))
        );
        assert_eq!(
            g(json!({"grammar": "root ::= \"a\""})),
            Some((Grammar::Gbnf("root ::= \"a\"".into()), "grammar"))
        );
        assert_eq!(
            g(json!({"grammar": "start: \"a\""})),
            Some((Grammar::Lark("start: \"a\"".into()), "grammar"))
        );
        assert_eq!(
            g(json!({"json_schema": s})),
            Some((Grammar::JsonSchema(s.clone()), "json_schema"))
        );
        assert_eq!(g(json!({"response_format": null, "grammar": null})), None);
    }

    #[test]
    fn bad_output_fields_name_themselves() {
        assert_eq!(
            param(grammar_of(json!({"response_format": "json"}))),
            "response_format"
        );
        assert_eq!(
            param(grammar_of(json!({"response_format": {"type": "xml"}}))),
            "response_format.type"
        );
        assert_eq!(
            param(grammar_of(
                json!({"response_format": {"type": "json_schema"}})
            )),
            "response_format.json_schema"
        );
        assert_eq!(
            param(grammar_of(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}})
            )),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            param(grammar_of(
                json!({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}})
            )),
            "response_format.json_schema.strict"
        );
        assert_eq!(param(grammar_of(json!({"grammar": 5}))), "grammar");
        assert_eq!(
            param(grammar_of(json!({"json_schema": "{}"}))),
            "json_schema"
        );
        assert_eq!(
            param(grammar_of(
                json!({"grammar": "start: \"a\"", "json_schema": {}})
            )),
            "json_schema"
        );
    }

    #[test]
    fn tools_and_choices_parse_and_bad_ones_name_their_field() {
        let t = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                       {"type": "function", "function": {"name": "g"}}]);
        let r = tools_of(
            json!({"tools": t, "tool_choice": {"type": "function", "function": {"name": "g"}},
                                "parallel_tool_calls": false}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.choice, ToolChoice::Function("g".into()));
        assert!(!r.parallel);
        assert_eq!(r.tools[1].parameters, json!({"type": "object"}));
        assert_eq!(
            tools_of(json!({"tools": t})).unwrap().unwrap().choice,
            ToolChoice::Auto
        );
        assert_eq!(tools_of(json!({"tool_choice": "none"})).unwrap(), None);
        assert_eq!(
            param(tools_of(json!({"tool_choice": "required"}))),
            "tool_choice"
        );
        assert_eq!(
            param(tools_of(json!({"tools": t, "tool_choice": "maybe"}))),
            "tool_choice"
        );
        assert_eq!(
            param(tools_of(
                json!({"tools": t, "tool_choice": {"type": "function", "function": {"name": "h"}}})
            )),
            "tool_choice"
        );
        assert_eq!(
            param(tools_of(json!({"tools": [{"type": "code"}]}))),
            "tools[0].type"
        );
        assert_eq!(
            param(tools_of(
                json!({"tools": [{"type": "function", "function": {}}]})
            )),
            "tools[0].function.name"
        );
        assert_eq!(
            param(tools_of(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]})
            )),
            "tools[0].function.parameters"
        );
        assert_eq!(param(tools_of(json!({"tools": {}}))), "tools");
        assert_eq!(
            param(tools_of(json!({"tools": t, "parallel_tool_calls": 1}))),
            "parallel_tool_calls"
        );
    }
}
