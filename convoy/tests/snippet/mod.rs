//! The code a test file shows in the README: what stands between its `// README:BEGIN` and
//! `// README:END` lines.

/// The lines between the markers of `source` (a test file's own text, `include_str!`).
pub fn between_markers(source: &str) -> &str {
    let begin = source.find("// README:BEGIN\n").expect("a README:BEGIN line") + "// README:BEGIN\n".len();
    let end = source.find("// README:END").expect("a README:END line");
    &source[begin..end]
}

/// Asserts that README.md shows `file`'s snippet verbatim (`source`: its own text).
pub fn assert_readme_shows(file: &str, source: &str) {
    assert!(
        include_str!("../../../README.md").contains(between_markers(source)),
        "README.md must show tests/{file}'s snippet verbatim"
    );
}
